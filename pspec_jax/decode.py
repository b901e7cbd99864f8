"""Decoding: speculative rounds inside one jitted `jax.lax.while_loop` (DESIGN.md section 3).

State between rounds: the target cache holds x_1..x_n; the *bonus* token x_{n+1}, chosen from
p_n, is known but not yet in the cache, and the drafter's proposals for the next round are
ready. A round

1. builds the token tree (static, or the most confident nodes of a dynamic pool; a gated tree
   cuts drafted nodes of low draft confidence), with a chain of prompt-lookup nodes below the
   root when the tree asks for one and the context repeats,
2. verifies it: one target pass over the M nodes at positions n+1+depth, tree mask + cache
   (parts of the tree that no sequence has this round, a lookup chain or gated drafts, are
   left out of the pass),
3. accepts a path and a new bonus token (`accept.accept`), greedy or lossless sampling (at
   T > 0 by default the drafted nodes were drawn from the drafter's distribution q and are
   accepted by speculative sampling, recursively on trees; `DecodeConfig.drafts`),
4. commits the path's keys/values into contiguous cache slots and its tokens (cut at EOS and
   at the token budget), and
5. feeds the accepted pairs (f_t, x_{t+1}) to the drafter, which proposes the next tree.

An adaptive tree (`tree="adaptive"`) picks, at the end of each round, which of its candidate
trees the next round drafts and verifies (`pspec_jax.adaptive`): a round then drafts that
candidate's nodes alone (the root alone: the drafter only takes in the new pairs), and the
target verifies them through the same `lax.switch` that leaves a lookup chain out.

Plain auto-regressive decoding (`drafter=None`) is the round whose tree is the root alone.
`generate` runs prefill plus rounds until every sequence is done, all on device; `stream`
drives the same jitted round function from the host. Shapes are fixed by (batch, prompt width,
max_new_tokens, tree), so prompts padded to the same width reuse the compiled program.

Sharded decoding: `shard` places target and drafter parameters on a mesh by the logical-axis
rules of training (`sharding.RULES`: heads, MLP width and vocabulary over `tensor`), and
`DecodeConfig.mesh` keeps the batch over `data` and the caches over batch and kv heads.
"""

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from pspec_jax import adaptive, sharding, tree_specs
from pspec_jax import tree as tree_lib
from pspec_jax.accept import accept
from pspec_jax.arrays import take_rows
from pspec_jax.drafter import Drafter
from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Target
from pspec_jax.propose import Draw, Pairs, draw_tables, feed, pld_candidates, propose
from pspec_jax.sampling import SamplingConfig, select

DRAFTS = ("sampled", "top_k")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """Static decoding settings (hashable: a change recompiles).

  Attributes:
    max_new_tokens: generation budget per sequence, EOS included.
    sampling: greedy (default) or temperature / top-k / top-p sampling.
    eos_ids: token ids that end a sequence (it is kept in the output).
    max_len: cache slots per sequence; 0 means prompt width + max_new_tokens + the longest
      path a round can accept (`Tree.max_depth`).
    pad_id: fills `DecodeOutput.tokens` past each sequence's length.
    num_draft: K, draft tokens per round; 0 means the drafter's own.
    tree: tree name (`tree.parse`: chain, sparseN, dynamic:N, paths:..., each optionally with
      a gate +min:P and +lookup:L; or adaptive, adaptive:A|B|...); "" is the drafter's for
      this temperature (`DrafterConfig.tree_for`).
    costs: an adaptive tree's cost of a round with each candidate, the root alone first (1.0),
      relative to a plain round: (lookup chain left out, lookup chain verified) pairs, as
      `infer.calibration` measures them; () is `adaptive.default_costs`' guess.
    mesh: shard the batch and the caches over this mesh (parameters: `shard`); None is one
      device.
    drafts: how a drafter with a distribution (pspec, eagle, medusa) drafts when sampling
      (T > 0): "sampled" draws each node's children from its filtered distribution q without
      replacement and accepts by speculative sampling (a draft is then accepted with
      probability 1 - TV(p, q)); "top_k" takes its most probable tokens and accepts them by the
      multi-child rule (a draft x with probability p(x)). Greedy decoding, pld and prompt-lookup
      nodes are deterministic either way.
  """

  max_new_tokens: int = 128
  sampling: SamplingConfig = SamplingConfig()
  eos_ids: tuple[int, ...] = ()
  max_len: int = 0
  pad_id: int = 0
  num_draft: int = 0
  tree: str = ""
  costs: tuple[tuple[float, float], ...] = ()
  mesh: Mesh | None = None
  drafts: str = "sampled"

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.max_len < 0:
      raise ValueError(f"max_len must be >= 0 (0: derived), got {self.max_len}")
    if self.num_draft < 0:
      raise ValueError(f"num_draft must be >= 0 (0: the drafter's own), got {self.num_draft}")
    if self.drafts not in DRAFTS:
      raise ValueError(f"drafts must be one of {', '.join(DRAFTS)}, got {self.drafts!r}")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    try:
      costs = tuple((float(a), float(b)) for a, b in self.costs)
    except (TypeError, ValueError):
      raise ValueError(f"costs must be (float, float) pairs, got {self.costs!r}") from None
    object.__setattr__(self, "costs", costs)


def pool_tree(cfg: DecodeConfig, drafter: Drafter | None) -> tree_lib.Tree:
  """The tree (or dynamic pool) drafted each round; the root alone without a drafter."""
  if drafter is None:
    return tree_lib.ROOT_ONLY
  tree = drafter.cfg.resolve_tree(cfg.tree or drafter.cfg.tree_for(cfg.sampling.greedy))
  return tree_specs.parse(tree, cfg.num_draft or drafter.cfg.num_draft)


def drawn_from_q(cfg: DecodeConfig, drafter: Drafter | None) -> bool:
  """Whether this decode draws its drafted nodes from the drafter's distribution q. Adaptive
  trees draft their candidates deterministically (the top-k rule) for now."""
  return (
    drafter is not None
    and not cfg.sampling.greedy
    and cfg.drafts == "sampled"
    and drafter.cfg.kind != "pld"
    and pool_tree(cfg, drafter).depth > 0
    and not pool_tree(cfg, drafter).candidates
  )


def round_costs(cfg: DecodeConfig, drafter: Drafter | None) -> tuple[tuple[float, float], ...]:
  """The adaptive tree's candidate costs: `cfg.costs`, else `adaptive.default_costs`."""
  pool = pool_tree(cfg, drafter)
  return cfg.costs or adaptive.default_costs(pool, drafter.cfg.kind)


@struct.dataclass
class DecodeState:
  cache: KVCache  # target cache; lengths[b] = n, the bonus excluded
  tokens: jax.Array  # [B, W] prompt then generated tokens; the bonus is tokens[b, n]
  prompt_lengths: jax.Array  # [B]
  done: jax.Array  # [B] bool
  rounds: jax.Array  # [B] verification rounds (target passes after prefill) while active
  accepted: jax.Array  # [B, P] rounds whose accepted path reached depth d + 1
  key: jax.Array  # PRNG key, folded with the round number
  step: jax.Array  # scalar: rounds run so far
  drafter_cache: KVCache | None  # the drafter's cache over real pairs, if it has one
  node_tokens: jax.Array  # [B, M] next round's drafted pool nodes (node 0 becomes the bonus)
  node_logp: jax.Array  # [B, M] their draft log-probabilities given their parents
  draft_logq: jax.Array  # [B, G, V] the q they were drawn from (`drawn_from_q`; else [B, 1, 1])
  adapt: adaptive.Stats | None = None  # an adaptive tree's statistics and next candidate

  @property
  def num_tokens(self) -> jax.Array:
    """[B] tokens known per sequence: the cache plus the bonus."""
    return self.cache.lengths + 1

  @property
  def num_generated(self) -> jax.Array:
    return self.num_tokens - self.prompt_lengths


@struct.dataclass
class DecodeOutput:
  tokens: jax.Array  # [B, max_new_tokens] generated ids, pad_id past `lengths`
  lengths: jax.Array  # [B] generated tokens, EOS included
  rounds: jax.Array  # [B] verification rounds (the prefill, which gives token 1, excluded)
  accepted_per_depth: jax.Array  # [B, P] rounds that accepted a draft token at depth d + 1
  chosen: jax.Array | None = None  # [C] rounds verified with each adaptive candidate

  @property
  def tau(self) -> jax.Array:
    """[B] mean tokens per verification round: accepted drafts + 1 (1 for plain decoding)."""
    return (self.lengths - 1) / jnp.maximum(self.rounds, 1)


@struct.dataclass
class Verified:
  """One round's verified tree: its arrays, tokens, and the target's outputs at every node."""

  tree: tree_lib.TreeArrays  # [B, ...]
  node_tokens: jax.Array  # [B, M]
  features: jax.Array  # [B, M, D]
  kv: tuple[jax.Array, jax.Array]  # [L, B, M, K, H] each
  logits: jax.Array  # [B, M, V] float32
  node_table: jax.Array | None = None  # [B, M] row of draft_logq a node was drawn from, or -1
  draft_logq: jax.Array | None = None  # [B, G, V] (`drawn_from_q`; else None)


def _is_eos(tokens: jax.Array, cfg: DecodeConfig) -> jax.Array:
  if not cfg.eos_ids:
    return jnp.zeros(tokens.shape, jnp.bool_)
  return jnp.isin(tokens, jnp.asarray(cfg.eos_ids, jnp.int32))


CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


def _constrain(x: jax.Array, logical: tuple, cfg: DecodeConfig) -> jax.Array:
  """x laid out on `cfg.mesh` by its logical axes (a no-op on one device)."""
  if cfg.mesh is None:
    return x
  spec = sharding.spec_for(jax.sharding.PartitionSpec(*logical), x.shape, cfg.mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(cfg.mesh, spec))


def _constrain_state(state: "DecodeState", cfg: DecodeConfig) -> "DecodeState":
  """The state's caches over batch and kv heads, its per-sequence arrays over batch."""
  if cfg.mesh is None:
    return state

  def cache(c):
    if c is None:
      return None

    def place(x):  # a per-layer buffer has no "layers" axis
      return _constrain(x, CACHE_AXES[-x.ndim :], cfg)

    return c.replace(k=jax.tree.map(place, c.k), v=jax.tree.map(place, c.v))

  return state.replace(
    cache=cache(state.cache),
    drafter_cache=cache(state.drafter_cache),
    tokens=_constrain(state.tokens, ("batch", "length"), cfg),
  )


def shard(mesh: Mesh, target: Target, drafter: Drafter | None = None):
  """Target and drafter with their parameters placed on `mesh` by the logical-axis rules.

  Returns (target, drafter); decode them with `DecodeConfig(mesh=mesh)`.
  """
  from pspec_jax import drafter as drafter_lib
  from pspec_jax import llama

  def place(params, init_boxed, cfg):
    return jax.device_put(params, sharding.param_shardings(init_boxed, cfg, mesh))

  target = target.replace(params=place(target.params, llama.init_boxed, target.cfg))
  if drafter is not None:
    replicated = sharding.replicated(mesh)
    drafter = drafter.replace(
      params=place(drafter.params, drafter_lib.init_boxed, drafter.cfg),
      vocab=None if drafter.vocab is None else jax.device_put(drafter.vocab, replicated),
      head=None if drafter.head is None else jax.device_put(drafter.head, replicated),
    )
  return target, drafter


def init(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig,
  drafter: Drafter | None = None,
) -> DecodeState:
  """Prefills the cache, chooses the first bonus token and drafts the first tree."""
  pool = pool_tree(cfg, drafter)
  batch, width = prompt_tokens.shape
  total = width + cfg.max_new_tokens
  max_len = cfg.max_len or total + pool.max_depth
  prompt_lengths = prompt_lengths.astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  features, kv = target(prompt_tokens, positions)
  # p_n sits at each sequence's last real token; pads after it are never read.
  last = jnp.take_along_axis(features, (prompt_lengths - 1)[:, None, None], axis=1)
  first = select(target.logits(last)[:, 0], jax.random.fold_in(key, 0), cfg.sampling)
  cache = target.empty_cache(batch, max_len).write(kv, prompt_lengths)
  is_prompt = jnp.arange(width)[None, :] < prompt_lengths[:, None]
  tokens = jnp.zeros((batch, total), jnp.int32)
  tokens = tokens.at[:, :width].set(jnp.where(is_prompt, prompt_tokens, 0))
  tokens = tokens.at[jnp.arange(batch), prompt_lengths].set(first)
  state = DecodeState(
    cache=cache,
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    done=_is_eos(first, cfg) | (cfg.max_new_tokens <= 1),
    rounds=jnp.zeros((batch,), jnp.int32),
    accepted=jnp.zeros((batch, pool.max_depth), jnp.int32),
    key=key,
    step=jnp.zeros((), jnp.int32),
    drafter_cache=None if drafter is None else drafter.empty_cache(batch, max_len),
    node_tokens=jnp.zeros((batch, 1), jnp.int32),
    node_logp=jnp.zeros((batch, 1), jnp.float32),
    draft_logq=jnp.zeros((batch, 1, 1), jnp.float32),
    adapt=adaptive.init_stats(pool, batch) if pool.candidates else None,
  )
  # Prompt pair t is (f_t, x_{t+1}); the last one carries the first bonus token.
  pairs = Pairs(tokens=tokens[:, 1 : width + 1], features=features, count=prompt_lengths)
  return _constrain_state(draft(target, drafter, state, pairs, cfg), cfg)


def verify(target: Target, state: DecodeState, cfg: DecodeConfig, drafter=None) -> Verified:
  """Steps 1-2: builds this round's tree and runs the target over its nodes.

  The target runs over the nodes some sequence can accept: a gated tree (`+min:P`) whose drafted
  nodes every sequence cut, or a lookup chain no sequence found, is left out of the pass (its
  outputs are zeros, never read), so such rounds cost what the rest of the tree costs.
  """
  pool = pool_tree(cfg, drafter)
  batch = state.tokens.shape[0]
  n = state.cache.lengths
  bonus = state.tokens[jnp.arange(batch), n]
  node_tokens = state.node_tokens.at[:, 0].set(bonus)
  node_logp = state.node_logp
  drawn = drawn_from_q(cfg, drafter)
  node_table = None
  if drawn:
    node_table = jnp.broadcast_to(draw_tables(drafter.cfg.kind, pool), node_tokens.shape)
  if pool.budget:
    kept, tree = tree_lib.select_dynamic(pool, node_logp)
    node_tokens = jnp.take_along_axis(node_tokens, kept, axis=1)
    node_logp = jnp.take_along_axis(node_logp, kept, axis=1)
    if drawn:
      node_table = jnp.take_along_axis(node_table, kept, axis=1)
  else:
    tree = tree_lib.batched(pool, batch)
  drafted = node_tokens.shape[1]
  if pool.candidates:
    return _verify_adaptive(target, state, pool, tree, node_tokens)
  # Each part of the tree that a round may leave out: its nodes, and whether this round has it.
  parts = []
  if pool.min_prob:
    tree = tree_lib.gated(tree, node_logp, pool.min_prob)
    parts.append((range(1, drafted), jnp.any(tree.children[:, 0] >= 0)))
  if pool.lookup:
    lookup_tokens, ok = pld_candidates(
      state.tokens, state.num_tokens, pool.lookup, LOOKUP_NGRAMS[1], LOOKUP_NGRAMS[0]
    )
    node_tokens = jnp.concatenate([node_tokens, lookup_tokens], axis=1)
    if drawn:  # lookup nodes are not drawn from q
      node_table = jnp.pad(node_table, ((0, 0), (0, pool.lookup)), constant_values=-1)
    tree = tree_lib.with_lookup(tree, ok)
    parts.append((range(drafted, drafted + pool.lookup), jnp.any(ok[:, 0])))
  num_nodes = node_tokens.shape[1]
  run = functools.partial(_run_nodes, target, state, tree, node_tokens)
  optional = {i for nodes, _ in parts for i in nodes}
  always = [i for i in range(num_nodes) if i not in optional]
  # Branch k runs the parts whose bit is set in k; the round picks the parts it has.
  branches = [
    functools.partial(
      run, always + [i for j, (nodes, _) in enumerate(parts) if k >> j & 1 for i in nodes]
    )
    for k in range(2 ** len(parts))
  ]
  if len(branches) == 1:
    features, kv, logits = branches[0]()
  else:
    index = sum(has.astype(jnp.int32) << j for j, (_, has) in enumerate(parts))
    features, kv, logits = jax.lax.switch(index, branches)
  return Verified(
    tree=tree,
    node_tokens=node_tokens,
    features=features,
    kv=kv,
    logits=logits,
    node_table=node_table,
    draft_logq=state.draft_logq if drawn else None,
  )


def _run_nodes(target, state, tree, node_tokens, nodes):
  """The target over these nodes (closed under ancestors) of the tree; zeros elsewhere."""
  n = state.cache.lengths
  num_nodes = node_tokens.shape[1]
  index = np.asarray(nodes)
  whole = len(index) == num_nodes
  tokens, depth, ancestors = node_tokens, tree.depth, tree.ancestors
  if not whole:
    tokens, depth, ancestors = tokens[:, index], depth[:, index], ancestors[:, index][:, :, index]
  features, kv = target(tokens, n[:, None] + depth, state.cache, ancestors)
  out = features, kv, target.logits(features)
  if whole:
    return out
  return jax.tree.map(lambda x, axis: _spread(x, axis, index, num_nodes), out, (1, (2, 2), 1))


def _verify_adaptive(target, state, pool, tree, node_tokens) -> Verified:
  """An adaptive round's verification: the union tree cut to the chosen candidate, and its
  lookup chain where a sequence found one; the pass covers exactly those nodes."""
  choice = state.adapt.choice
  tree, chain_L = adaptive.restrict(tree, pool, choice)
  runs = jnp.bool_(False)
  if pool.lookup:
    lookup_tokens, ok = pld_candidates(
      state.tokens, state.num_tokens, pool.lookup, LOOKUP_NGRAMS[1], LOOKUP_NGRAMS[0]
    )
    ok = ok & chain_L[None, :]
    node_tokens = jnp.concatenate([node_tokens, lookup_tokens], axis=1)
    tree = tree_lib.with_lookup(tree, ok)
    runs = jnp.any(ok[:, 0])
  # One branch per distinct node set, (candidate, lookup runs) -> branch.
  sets = adaptive.branch_nodes(pool)
  unique = list(dict.fromkeys(sets))
  run = functools.partial(_run_nodes, target, state, tree, node_tokens)
  branches = [functools.partial(run, nodes) for nodes in unique]
  which = jnp.asarray([unique.index(nodes) for nodes in sets], jnp.int32)
  index = which[2 * choice + runs.astype(jnp.int32)]
  features, kv, logits = jax.lax.switch(index, branches)
  return Verified(tree=tree, node_tokens=node_tokens, features=features, kv=kv, logits=logits)


# Prompt lookup finds the context's last 3, else last 2 tokens earlier in it; a lone repeated
# token predicts too little to be worth verifying.
LOOKUP_NGRAMS = (2, 3)


def _spread(x: jax.Array, axis: int, index: np.ndarray, size: int) -> jax.Array:
  """x placed at `index` along `axis` of a zero array `size` long there."""
  shape = x.shape[:axis] + (size,) + x.shape[axis + 1 :]
  where = (slice(None),) * axis + (index,)
  return jnp.zeros(shape, x.dtype).at[where].set(x)


def accept_path(state: DecodeState, verified: Verified, cfg: DecodeConfig, drafter=None):
  """Step 3: every sequence's accepted path [B, P+1], drafts accepted [B] and bonus token [B],
  with this round's key (the choice `commit` makes)."""
  drafts = None
  if verified.node_table is not None:
    drafts = (verified.node_table, verified.draft_logq)
  return accept(
    verified.logits,
    verified.node_tokens,
    verified.tree,
    pool_tree(cfg, drafter).max_depth,
    jax.random.fold_in(state.key, state.step + 1),
    cfg.sampling,
    drafts,
  )


def commit(
  state: DecodeState, verified: Verified, cfg: DecodeConfig, drafter=None
) -> tuple[DecodeState, Pairs]:
  """Steps 3-4: accepts a path, writes its tokens and keys/values; returns the new pairs.

  A sequence keeps the accepted drafts and the bonus, cut after its first EOS and at its token
  budget; finished sequences idle (nothing written, counters unchanged).
  """
  return _commit_path(state, verified, cfg, drafter, accept_path(state, verified, cfg, drafter))


def _commit_path(state, verified, cfg, drafter, accepted) -> tuple[DecodeState, Pairs]:
  """`commit` of an accepted (path, num_accepted, bonus) that `accept_path` gave."""
  path, num_accepted, bonus = accepted
  depth = pool_tree(cfg, drafter).max_depth
  batch, total = state.tokens.shape
  rows = jnp.arange(batch)
  active = ~state.done
  n = state.cache.lengths
  step = state.step + 1
  # New tokens x_{n+2}..: the accepted drafts below the root, then the bonus.
  drafts = take_rows(verified.node_tokens, path)[:, 1:]
  new = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  new = new.at[rows, num_accepted].set(bonus)
  index = jnp.arange(depth + 1)[None, :]
  offered = num_accepted + 1
  eos = _is_eos(new, cfg) & (index < offered[:, None])
  first_eos = jnp.min(jnp.where(eos, index, depth + 1), axis=1)
  budget = cfg.max_new_tokens - state.num_generated
  kept = jnp.where(active, jnp.minimum(jnp.minimum(offered, first_eos + 1), budget), 0)
  # The root and the kept drafts but the last enter the cache; the last kept token is the bonus.
  kv_path = tuple(jnp.take_along_axis(x, path[None, :, :, None, None], axis=2) for x in verified.kv)
  cache = state.cache.write(kv_path, kept)
  # Rows past `kept` write to index `total`, which mode="drop" discards.
  where = jnp.where(index < kept[:, None], n[:, None] + 1 + index, total)
  tokens = state.tokens.at[rows[:, None], where].set(new, mode="drop")
  finished = jnp.any(eos & (index < kept[:, None]), axis=1) | (kept >= budget)
  state = state.replace(
    cache=cache,
    tokens=tokens,
    step=step,
    rounds=state.rounds + active,
    accepted=state.accepted + (jnp.arange(depth)[None, :] < kept[:, None] - 1),
    done=state.done | (active & finished),
  )
  pairs = Pairs(tokens=new, features=take_rows(verified.features, path), count=kept)
  return state, pairs


def draft(
  target: Target, drafter: Drafter | None, state: DecodeState, pairs: Pairs, cfg: DecodeConfig
) -> DecodeState:
  """Step 5: the drafter consumes the new pairs and drafts the next round's tree pool."""
  if drafter is None:
    return state
  context = (state.tokens, state.num_tokens)
  pool = pool_tree(cfg, drafter)
  if pool.candidates:
    return _draft_adaptive(target, drafter, state, pairs, cfg, pool)
  draw = None
  if drawn_from_q(cfg, drafter):
    # A stream of its own: keys derived from the rounds' keys (`accept_path` splits
    # fold_in(key, step)) could repeat one of theirs (fold_in(k, 1) is split(k)[1]), and drafts
    # that reuse the last round's random bits would follow what it accepted.
    stream = jax.random.fold_in(state.key, DRAFT_STREAM)
    draw = Draw(cfg.sampling, jax.random.fold_in(stream, state.step))
  drafter_cache, nodes = propose(drafter, target, state.drafter_cache, pairs, context, pool, draw)
  state = state.replace(drafter_cache=drafter_cache, node_tokens=nodes[0], node_logp=nodes[1])
  return state.replace(draft_logq=nodes[2]) if draw is not None else state


# Rounds fold their step (>= 0, far below this) into the decode's key; drafts use this stream.
DRAFT_STREAM = 2**32 - 1


def _draft_adaptive(target, drafter, state, pairs, cfg, pool) -> DecodeState:
  """Chooses the next round's candidate (`adaptive.choose`) and drafts its nodes alone, placed
  at their indices in the union tree; the root alone drafts nothing."""
  context = (state.tokens, state.num_tokens)
  batch = state.tokens.shape[0]
  found = jnp.zeros((batch,), jnp.bool_)
  if pool.lookup:
    found = pld_candidates(state.tokens, state.num_tokens, 1, LOOKUP_NGRAMS[1], LOOKUP_NGRAMS[0])[
      1
    ][:, 0]
  costs = round_costs(cfg, drafter)
  choice = adaptive.choose(state.adapt, pool, costs, found, ~state.done)
  union = {p: i + 1 for i, p in enumerate(pool.paths)}

  def drafted(cand):
    if not cand.paths:
      cache = feed(drafter, target, state.drafter_cache, pairs)
      return (
        cache,
        jnp.zeros((batch, pool.num_nodes), jnp.int32),
        jnp.zeros((batch, pool.num_nodes)),
      )
    cache, (tokens, logp) = propose(drafter, target, state.drafter_cache, pairs, context, cand)
    index = np.asarray([0] + [union[p] for p in cand.paths])
    place = lambda x: jnp.zeros((batch, pool.num_nodes), x.dtype).at[:, index].set(x)
    return cache, place(tokens), place(logp.astype(jnp.float32))

  # One branch per distinct drafted part (candidates differing in their lookup chain share one).
  shapes = [tree_lib.Tree(paths=c.paths) for c in pool.candidates]
  unique = list(dict.fromkeys(shapes))
  which = jnp.asarray([unique.index(t) for t in shapes], jnp.int32)
  branches = [functools.partial(drafted, t) for t in unique]
  cache, node_tokens, node_logp = jax.lax.switch(which[choice], branches)
  return state.replace(
    drafter_cache=cache,
    node_tokens=node_tokens,
    node_logp=node_logp,
    adapt=state.adapt.replace(choice=choice),
  )


def round_step(
  target: Target, state: DecodeState, cfg: DecodeConfig, drafter: Drafter | None = None
) -> DecodeState:
  """One round: verify the drafted tree, accept and commit, draft the next tree."""
  verified = verify(target, state, cfg, drafter)
  accepted = accept_path(state, verified, cfg, drafter)
  before = state
  state, pairs = _commit_path(state, verified, cfg, drafter, accepted)
  if state.adapt is not None:
    path, num_accepted, _ = accepted
    pool = pool_tree(cfg, drafter)
    stats = adaptive.observe(before.adapt, pool, verified.tree, path, num_accepted, ~before.done)
    state = state.replace(adapt=stats)
  return _constrain_state(draft(target, drafter, state, pairs, cfg), cfg)


def finish(state: DecodeState, cfg: DecodeConfig) -> DecodeOutput:
  """Cuts each sequence's generated tokens out of the state."""
  lengths = state.num_generated
  index = state.prompt_lengths[:, None] + jnp.arange(cfg.max_new_tokens)[None, :]
  tokens = jnp.take_along_axis(state.tokens, index, axis=1, mode="clip")
  valid = jnp.arange(cfg.max_new_tokens)[None, :] < lengths[:, None]
  return DecodeOutput(
    tokens=jnp.where(valid, tokens, cfg.pad_id),
    lengths=lengths,
    rounds=state.rounds,
    accepted_per_depth=state.accepted,
    chosen=None if state.adapt is None else state.adapt.chosen,
  )


def _generate(target, drafter, prompt_tokens, prompt_lengths, key, cfg):
  prompt_tokens = _constrain(prompt_tokens, ("batch", "length"), cfg)
  prompt_lengths = _constrain(prompt_lengths, ("batch",), cfg)
  if drafter is not None:
    drafter = drafter.with_head(target)  # loop-invariant: gathered once, not every round
  state = init(target, prompt_tokens, prompt_lengths, key, cfg, drafter)
  state = jax.lax.while_loop(
    lambda s: ~jnp.all(s.done), lambda s: round_step(target, s, cfg, drafter), state
  )
  return finish(state, cfg)


_generate_jit = jax.jit(_generate, static_argnames="cfg")
_init_jit = jax.jit(init, static_argnames="cfg")
_round_jit = jax.jit(round_step, static_argnames="cfg", donate_argnames="state")


def check_inputs(
  target: Target, prompt_tokens, prompt_lengths, cfg: DecodeConfig, drafter: Drafter | None = None
) -> None:
  """Raises one clear ValueError for inputs the jitted loop cannot handle.

  Shapes are always checked; lengths only when they are concrete (not inside a user's jit).
  """
  if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
    raise ValueError(
      f"prompt_tokens must be [batch, width] and prompt_lengths [batch], got "
      f"{prompt_tokens.shape} and {prompt_lengths.shape}"
    )
  if drafter is not None:
    check_drafter(target, drafter, cfg)
  pool = pool_tree(cfg, drafter)
  if pool.candidates and cfg.costs:
    adaptive.check_costs(pool, cfg.costs)
  depth = pool.max_depth
  width = prompt_tokens.shape[1]
  needed = width + cfg.max_new_tokens + depth
  if cfg.max_len and needed > cfg.max_len:
    raise ValueError(
      f"prompt width {width} + max_new_tokens {cfg.max_new_tokens} + tree depth {depth} = "
      f"{needed} does not fit the cache of {cfg.max_len} slots: shorten the prompt, lower K or "
      "raise max_len"
    )
  context = target.cfg.max_position_embeddings
  if needed > context:
    raise ValueError(
      f"prompt width {width} + max_new_tokens {cfg.max_new_tokens} + tree depth {depth} = "
      f"{needed} exceeds the target's context of {context} tokens: shorten the prompt or "
      "lower max_new_tokens"
    )
  try:
    lengths = np.asarray(prompt_lengths)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return
  if np.any(lengths < 1):
    raise ValueError("empty prompt: every sequence needs at least one token")
  if np.any(lengths > width):
    raise ValueError(f"prompt_lengths exceed the prompt width {width}: {lengths.tolist()}")


def check_drafter(target: Target, drafter: Drafter, cfg: DecodeConfig) -> None:
  """The drafter must fit the target, and K the drafter."""
  d, t = drafter.cfg, target.cfg
  if (d.vocab_size, d.hidden_size) != (t.vocab_size, t.hidden_size):
    raise ValueError(
      f"the drafter was built for target {d.target_name!r} (vocab {d.vocab_size}, width "
      f"{d.hidden_size}), not for {t.name!r} (vocab {t.vocab_size}, width {t.hidden_size})"
    )
  depth = pool_tree(cfg, drafter).depth
  if d.kind in ("pspec", "medusa") and depth > d.num_draft:
    raise ValueError(
      f"the {d.kind} drafter proposes at most K={d.num_draft} tokens, the tree needs {depth}: "
      f"lower num_draft or the tree depth"
    )


def generate(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
  drafter: Drafter | None = None,
) -> DecodeOutput:
  """Generates up to `cfg.max_new_tokens` tokens per prompt, entirely on device.

  Speculative with a drafter, plain auto-regressive without; the output is the target's either
  way (token for token when greedy, in distribution when sampling). Pure and jittable: it may
  be called inside a user's own `jax.jit` (params and token arrays traced, `cfg` static).

  Args:
    target: the target model and its parameters.
    prompt_tokens: [B, T] int token ids, right-padded.
    prompt_lengths: [B] real tokens per prompt (>= 1).
    key: PRNG key; unused when greedy.
    cfg: decoding settings (tree and K included).
    drafter: a drafter built for this target, or None for plain decoding.

  Returns:
    DecodeOutput with the generated tokens, their count and per-sequence stats.
  """
  check_inputs(target, prompt_tokens, prompt_lengths, cfg, drafter)
  tokens, lengths = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
  return _generate_jit(target, drafter, tokens, lengths, key, cfg)


def compile_generate(
  target: Target,
  prompt_tokens,
  prompt_lengths,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
  drafter: Drafter | None = None,
) -> jax.stages.Compiled:
  """`generate`'s program compiled for these arguments, which may be abstract (shapes with
  shardings): for its memory and cost analysis; nothing runs and nothing is allocated."""
  return _generate_jit.lower(target, drafter, prompt_tokens, prompt_lengths, key, cfg).compile()


def stream(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
  drafter: Drafter | None = None,
) -> Iterator[list[np.ndarray]]:
  """Like `generate`, one round at a time: yields each sequence's new tokens per round.

  Every yield is a list of B int arrays (empty for sequences that are done). Concatenated, they
  are exactly `generate`'s tokens for the same inputs.
  """
  check_inputs(target, prompt_tokens, prompt_lengths, cfg, drafter)
  tokens, lengths = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
  if drafter is not None:
    drafter = drafter.with_head(target)
  state = _init_jit(target, tokens, lengths, key, cfg, drafter)
  seen = np.asarray(prompt_lengths)
  while True:
    tokens, known, done = jax.device_get((state.tokens, state.num_tokens, state.done))
    yield [tokens[b, seen[b] : known[b]] for b in range(len(seen))]
    seen = known
    if done.all():
      return
    state = _round_jit(target, state, cfg, drafter)
