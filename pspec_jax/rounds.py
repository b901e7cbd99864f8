"""One speculative round, as pure functions of a static `Plan` (docs/design.md section 3).

State between rounds: the target cache holds x_1..x_n; the *bonus* token x_{n+1} is known but
not yet in the cache, and the drafter's proposals for the next round are ready. A round builds
the token tree (3.3: static, dynamic or gated, with a prompt-lookup chain when the context
repeats), verifies it in one target pass that leaves out the parts no sequence has (3.4),
accepts a path and a new bonus token, greedy or lossless sampling (3.5), commits the path's
keys/values and tokens, cut at EOS and the budget (3.6), and feeds the accepted pairs to the
drafter, which proposes the next tree. An adaptive tree's round drafts, verifies and commits the
candidate its statistics chose, each option in a loop of its own (3.7).

Every function takes the plan first, then whichever of target, drafter and state it uses:
`init(plan, target, drafter, tokens, lengths, key, costs)`, `verify(plan, target, drafter, state)`,
`accept_path(plan, state, verified)`, `commit(plan, state, verified)`,
`draft(plan, target, drafter, state, pairs)`, `round_step(plan, target, drafter, state)`.
`pspec_jax.decode` exports them jitted and runs them in one loop.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pspec_jax import adaptive, sharding
from pspec_jax import tree as tree_lib
from pspec_jax.accept import accept, bonus_noise
from pspec_jax.arrays import take_rows
from pspec_jax.decode_plan import Plan
from pspec_jax.drafter import Drafter, read_target
from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Target
from pspec_jax.propose import Draw, Pairs, draw_tables, feed, pld_candidates, propose
from pspec_jax.sampling import select

__all__ = [
  "DecodeState",
  "Verified",
  "accept_path",
  "adaptive_rounds",
  "commit",
  "draft",
  "init",
  "round_step",
  "run",
  "verify",
  "with_buffers",
  "without_buffers",
]

# Prompt lookup finds the context's last 3, else last 2 tokens earlier in it; a lone repeated
# token predicts too little to be worth verifying.
LOOKUP_NGRAMS = (2, 3)
# Rounds fold their step (>= 0, far below this) into the decode's key; drafts use this stream.
DRAFT_STREAM = 2**32 - 1
# An adaptive tree's rounds that draft nothing leave their pairs pending, to be taken in with a
# later round's (its drafter pass, or a feed once the buffer of this many rounds' width fills),
# so a round that verifies the root alone need not pay one. The wider pass that follows costs
# little: whole decodes pinned to one drafted candidate did not tell this buffer from a
# one-round one (docs/design.md section 3.7).
PENDING_ROUNDS = 2
# The narrowest prefill below a prompt width (`prefill_widths`): prompts padded to 64 or fewer
# tokens are prefilled at their width, in one compiled pass.
MIN_PREFILL_WIDTH = 64
CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


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
  draft_logq: jax.Array  # [B, G, V] the q they were drawn from (`Plan.drawn`; else [B, 1, 1])
  adapt: adaptive.Stats | None = None  # an adaptive tree's statistics and next candidate
  pending: Pairs | None = None  # adaptive: pairs the drafter's cache has not taken in yet

  @property
  def num_tokens(self) -> jax.Array:
    """[B] tokens known per sequence: the cache plus the bonus."""
    return self.cache.lengths + 1

  @property
  def num_generated(self) -> jax.Array:
    return self.num_tokens - self.prompt_lengths


@struct.dataclass
class Verified:
  """One round's verified tree: its arrays, tokens, and the target's outputs at every node."""

  tree: tree_lib.TreeArrays  # [B, ...]
  node_tokens: jax.Array  # [B, M]
  features: jax.Array  # [B, M, E] the feature h the drafter reads at every node (`read_target`)
  kv: tuple[jax.Array, jax.Array]  # [L, B, M, K, H] each
  logits: jax.Array  # [B, M, V] float32
  node_table: jax.Array | None = None  # [B, M] row of draft_logq a node was drawn from, or -1
  draft_logq: jax.Array | None = None  # [B, G, V] (`Plan.drawn`; else None)


def _is_eos(tokens: jax.Array, plan: Plan) -> jax.Array:
  if not plan.eos_ids:
    return jnp.zeros(tokens.shape, jnp.bool_)
  return jnp.isin(tokens, jnp.asarray(plan.eos_ids, jnp.int32))


def _constrain_state(plan: Plan, state: DecodeState) -> DecodeState:
  """The state's caches over batch and kv heads, its per-sequence arrays over batch."""
  if plan.mesh is None:
    return state

  def cache(c):
    if c is None:
      return None

    def place(x):  # a per-layer buffer has no "layers" axis
      return sharding.constrain(x, CACHE_AXES[-x.ndim :], plan.mesh)

    return c.replace(k=jax.tree.map(place, c.k), v=jax.tree.map(place, c.v))

  pending = state.pending
  if pending is not None:
    pending = jax.tree.map(
      lambda x: sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1), plan.mesh), pending
    )
  return state.replace(
    cache=cache(state.cache),
    drafter_cache=cache(state.drafter_cache),
    tokens=sharding.constrain(state.tokens, ("batch", "length"), plan.mesh),
    pending=pending,
  )


def init(
  plan: Plan,
  target: Target,
  drafter: Drafter | None,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  costs=None,
) -> DecodeState:
  """Prefills the cache, chooses the first bonus token and drafts the first tree.

  `costs`: an adaptive tree's round costs, [C, 2] (`DecodeConfig.costs`); None is
  `adaptive.default_costs`' guess. They ride in the state, so the compiled program does not
  depend on them."""
  pool = plan.tree
  batch, width = prompt_tokens.shape
  total = width + plan.max_new_tokens
  prompt_lengths = prompt_lengths.astype(jnp.int32)
  last, hidden, kv = _prefill(target, drafter, prompt_tokens, prompt_lengths)
  first = select(target.logits(last)[:, 0], jax.random.fold_in(key, 0), plan.sampling)
  cache = target.empty_cache(batch, plan.max_len).write(kv, prompt_lengths)
  is_prompt = jnp.arange(width)[None, :] < prompt_lengths[:, None]
  tokens = jnp.zeros((batch, total), jnp.int32)
  tokens = tokens.at[:, :width].set(jnp.where(is_prompt, prompt_tokens, 0))
  tokens = tokens.at[jnp.arange(batch), prompt_lengths].set(first)
  state = DecodeState(
    cache=cache,
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    done=_is_eos(first, plan) | (plan.max_new_tokens <= 1),
    rounds=jnp.zeros((batch,), jnp.int32),
    accepted=jnp.zeros((batch, pool.max_depth), jnp.int32),
    key=key,
    step=jnp.zeros((), jnp.int32),
    drafter_cache=None if drafter is None else drafter.empty_cache(batch, plan.max_len),
    node_tokens=jnp.zeros((batch, 1), jnp.int32),
    node_logp=jnp.zeros((batch, 1), jnp.float32),
    draft_logq=jnp.zeros((batch, 1, 1), jnp.float32),
    adapt=(
      adaptive.init_stats(
        pool,
        batch,
        adaptive.default_costs(pool, plan.kind) if costs is None else costs,
        plan.sampling.greedy,
      )
      if pool.candidates
      else None
    ),
  )
  # Prompt pair t is (h_t, x_{t+1}); the last one carries the first bonus token.
  pairs = Pairs(tokens=tokens[:, 1 : width + 1], features=hidden, count=prompt_lengths)
  if pool.candidates:
    return _constrain_state(plan, _init_adaptive(plan, target, drafter, state, pairs))
  return _constrain_state(plan, draft(plan, target, drafter, state, pairs))


def prefill_widths(width: int) -> list[int]:
  """The widths a prefill of prompts padded to `width` may run at: the powers of two below it
  from a quarter of it (each is one more compiled pass, about 2 s on a 2-core CPU for the
  embedded default) and from `MIN_PREFILL_WIDTH`, and `width` itself."""
  lowest = max(MIN_PREFILL_WIDTH, -(-width // 4))
  narrower = [w for w in (1 << i for i in range(32)) if lowest <= w < width]
  return narrower + [width]


def _prefill(target, drafter, tokens_BW, lengths_B):
  """The target over the prompts: (f at each sequence's last token [B, 1, D], the drafter's
  features h [B, W, E], keys/values [L, B, W, K, H]), zeros past the width run.

  The pass runs at the narrowest of `prefill_widths` that holds every prompt, each width its
  own `lax.switch` branch: prompts are padded to a bucket of a prompt set (or a batch), and a
  pass over the pads costs what one over real tokens does (0.6 ms a row for the embedded
  default on a 2-core CPU, where 53 tokens padded to 128 took 75 ms instead of 39)."""
  batch, width = tokens_BW.shape
  cfg = drafter and drafter.cfg

  def run(w):
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (batch, w))
    features, hidden, kv = read_target(target, cfg, tokens_BW[:, :w], positions)
    # p_n sits at each sequence's last real token; pads after it are never read.
    last = jnp.take_along_axis(features, (lengths_B - 1)[:, None, None], axis=1)
    return last, _pad(hidden, 1, width), tuple(_pad(x, 2, width) for x in kv)

  return _at_narrowest(prefill_widths(width), jnp.max(lengths_B), run)


def _at_narrowest(widths: list[int], needed: jax.Array, run):
  """`run(w)` at the narrowest of the ascending `widths` that is at least `needed`, each width
  its own `lax.switch` branch (one width: no switch)."""
  if len(widths) == 1:
    return run(widths[0])
  index = jnp.searchsorted(jnp.asarray(widths), needed)
  return jax.lax.switch(index, [functools.partial(run, w) for w in widths])


def verify(
  plan: Plan, target: Target, drafter: Drafter | None, state: DecodeState, lookup=None
) -> Verified:
  """Steps 1-2: builds this round's tree and runs the target over its nodes.

  The target runs over the nodes some sequence can accept: a gated tree (`+min:P`) whose drafted
  nodes every sequence cut, or a lookup chain no sequence found, is left out of the pass (its
  outputs are zeros, never read), so such rounds cost what the rest of the tree costs.
  `lookup`: the prompt-lookup chains (`pld_candidates`) if already found, at least as long as
  the tree's, by a round that verifies them because some sequence found one: the chain is then
  part of the pass. (`round_step` runs a round whose chains nobody found as the drafted tree
  alone, `_round_lookup`.) An adaptive tree's round verifies inside `round_step`
  (`_option_round`).
  """
  if plan.tree.candidates:
    raise ValueError(
      "an adaptive tree's round verifies, accepts and commits its candidate in one step: "
      "run round_step"
    )
  pool = plan.tree
  batch = state.tokens.shape[0]
  n = state.cache.lengths
  bonus = state.tokens[jnp.arange(batch), n]
  node_tokens = state.node_tokens.at[:, 0].set(bonus)
  node_logp = state.node_logp
  drawn = plan.drawn
  node_table = None
  if drawn:
    node_table = jnp.broadcast_to(draw_tables(plan.kind, pool), node_tokens.shape)
  if pool.budget:
    kept, tree = tree_lib.select_dynamic(pool, node_logp)
    node_tokens = jnp.take_along_axis(node_tokens, kept, axis=1)
    node_logp = jnp.take_along_axis(node_logp, kept, axis=1)
    if drawn:
      node_table = jnp.take_along_axis(node_table, kept, axis=1)
  else:
    tree = tree_lib.batched(pool, batch)
  drafted = node_tokens.shape[1]
  # Each part of the tree that a round may leave out: its nodes, and whether this round has it.
  parts = []
  if pool.min_prob:
    tree = tree_lib.gated(tree, node_logp, pool.min_prob)
    parts.append((range(1, drafted), jnp.any(tree.children[:, 0] >= 0)))
  if pool.lookup:
    tree, node_tokens, node_table, ok = _with_lookup(
      state, pool, tree, node_tokens, node_table, lookup
    )
    if lookup is None:
      parts.append((range(drafted, drafted + pool.lookup), jnp.any(ok[:, 0])))
  num_nodes = node_tokens.shape[1]
  run = functools.partial(_run_nodes, target, drafter, state, tree, node_tokens)
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


def _find_chains(state: DecodeState, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every sequence's prompt-lookup chain of `length` tokens and where it was found, [B, L]
  each, and [B] how far back its match runs (`pld_candidates` over `LOOKUP_NGRAMS`)."""
  shortest, longest = LOOKUP_NGRAMS
  return pld_candidates(
    state.tokens, state.num_tokens, length, longest, shortest, max_match=adaptive.LONG_MATCH
  )


def _with_lookup(state, pool, tree, node_tokens, node_table, lookup=None):
  """The tree with its prompt-lookup chain appended where a sequence found a match: (tree,
  node_tokens, node_table, ok [B, L]). Lookup nodes are not drawn from q: their `node_table`
  rows are -1. `lookup`: the chains if already found (`pld_candidates`, L or more long)."""
  if lookup is None:
    lookup = _find_chains(state, pool.lookup)
  lookup_tokens, ok = (x[:, : pool.lookup] for x in lookup[:2])
  node_tokens = jnp.concatenate([node_tokens, lookup_tokens], axis=1)
  if node_table is not None:
    node_table = jnp.pad(node_table, ((0, 0), (0, pool.lookup)), constant_values=-1)
  return tree_lib.with_lookup(tree, ok), node_tokens, node_table, ok


def _run_nodes(target, drafter, state, tree, node_tokens, nodes):
  """The target over these nodes (closed under ancestors) of the tree: the drafter's features
  h, keys/values and logits; zeros elsewhere."""
  n = state.cache.lengths
  num_nodes = node_tokens.shape[1]
  index = np.asarray(nodes)
  whole = len(index) == num_nodes
  tokens, depth, ancestors = node_tokens, tree.depth, tree.ancestors
  if not whole:
    tokens, depth, ancestors = tokens[:, index], depth[:, index], ancestors[:, index][:, :, index]
  cfg = drafter and drafter.cfg
  features, hidden, kv = read_target(
    target, cfg, tokens, n[:, None] + depth, state.cache, ancestors
  )
  out = hidden, kv, target.logits(features)
  if whole:
    return out
  return jax.tree.map(lambda x, axis: _spread(x, axis, index, num_nodes), out, (1, (2, 2), 1))


def _round_lookup(plan, target, drafter, state) -> tuple[DecodeState, Pairs]:
  """Steps 1-4 of a round of a fixed tree with a lookup chain: the tree with its chain where a
  sequence found one, else the drafted tree alone, each its own branch of a `lax.cond`. Left
  out inside one pass instead (`verify`'s parts), a chain nobody found had cost such a round
  0.04-0.05 of a plain round more (`paths:0+lookup:6` on the embedded target), paid in the 84%
  of chat rounds that find no match."""
  pool = plan.tree
  lookup = _find_chains(state, pool.lookup)
  noise = _bonus_noise(plan, target, state)
  on = jax.lax.cond(
    jnp.any(lookup[1][:, 0]),
    lambda: _round_as(plan, pool, target, drafter, state, lookup, noise),
    lambda: _round_as(plan, pool.drafted, target, drafter, state, None, noise),
  )
  return _write_path(plan, state, on)


def _round_as(plan, tree, target, drafter, state, lookup, noise):
  """Steps 1-3 of a round of `plan`, verified and accepted as `tree` (the plan's tree with its
  chain, or without): what it accepted, padded to the plan's longest path."""
  fixed = dataclasses.replace(plan, tree=tree, drawn=plan.drawn and tree.depth > 0)
  verified = verify(fixed, target, drafter, state, lookup)
  accepted = accept_path(fixed, state, verified, noise)
  on = _on_path(verified, accepted)
  width = plan.max_depth + 1
  return on.replace(
    tokens=_pad(on.tokens, 1, width),
    kv=tuple(_pad(x, 2, width) for x in on.kv),
    features=_pad(on.features, 1, width),
  )


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
  """x zero-padded to `size` along `axis`."""
  return jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])


def _bonus_noise(plan, target, state) -> jax.Array | None:
  """The round's bonus draw's noise when sampling (`accept.bonus_noise`), drawn before a round
  branches (`_round_lookup`): inside a branch, threefry costs a CPU round far more."""
  if plan.sampling.greedy:
    return None
  return bonus_noise(_round_key(state), (state.tokens.shape[0], target.cfg.vocab_size))


def _spread(x: jax.Array, axis: int, index: np.ndarray, size: int) -> jax.Array:
  """x placed at `index` along `axis` of a zero array `size` long there."""
  shape = x.shape[:axis] + (size,) + x.shape[axis + 1 :]
  where = (slice(None),) * axis + (index,)
  return jnp.zeros(shape, x.dtype).at[where].set(x)


def _round_key(state: DecodeState) -> jax.Array:
  return jax.random.fold_in(state.key, state.step + 1)


def accept_path(plan: Plan, state: DecodeState, verified: Verified, noise_BV=None):
  """Step 3: every sequence's accepted path [B, P+1], drafts accepted [B] and bonus token [B],
  with this round's key (the choice `commit` makes); `noise_BV`: its bonus draw's noise, if
  drawn already (`accept.bonus_noise`)."""
  drafts = None
  if verified.node_table is not None:
    drafts = (verified.node_table, verified.draft_logq)
  return accept(
    verified.logits,
    verified.node_tokens,
    verified.tree,
    plan.max_depth,
    _round_key(state),
    plan.sampling,
    drafts,
    noise_BV,
  )


def commit(plan: Plan, state: DecodeState, verified: Verified) -> tuple[DecodeState, Pairs]:
  """Steps 3-4: accepts a path, writes its tokens and keys/values; returns the new pairs.
  (An adaptive tree's round commits inside `round_step`.)

  A sequence keeps the accepted drafts and the bonus, cut after its first EOS and at its token
  budget; finished sequences idle (nothing written, counters unchanged).
  """
  return _write_path(plan, state, _on_path(verified, accept_path(plan, state, verified)))


@struct.dataclass
class OnPath:
  """What a round accepted, read off its verified tree along each sequence's path [B, P + 1]."""

  tokens: jax.Array  # [B, P + 1] the path's tokens (the root's, then the drafts')
  kv: tuple[jax.Array, jax.Array]  # [L, B, P + 1, K, H] each
  features: jax.Array  # [B, P + 1, E]
  num_accepted: jax.Array  # [B]
  bonus: jax.Array  # [B]


def _on_path(verified: Verified, accepted) -> OnPath:
  path, num_accepted, bonus = accepted
  return OnPath(
    tokens=take_rows(verified.node_tokens, path),
    kv=tuple(jnp.take_along_axis(x, path[None, :, :, None, None], axis=2) for x in verified.kv),
    features=take_rows(verified.features, path),
    num_accepted=num_accepted,
    bonus=bonus,
  )


def _tied_to_pass(kv, bonus_B):
  """The path's keys/values [L, B, T, K, H], made to depend on the bonus token, so on the whole
  pass: plain decoding's write (its path is the root) does not otherwise depend on the
  attention that reads the cache, and XLA copied each layer's cache twice per step, as if the
  write could come first (docs/design.md 3.6). A select on `bonus >= 0` (always true: a token
  id) keeps the values bit for bit; XLA:CPU drops an optimization barrier before its copy
  insertion, which then still copied the last layer's."""
  valid = (bonus_B >= 0)[None, :, None, None, None]
  return tuple(jnp.where(valid, x, jnp.zeros_like(x)) for x in kv)


def _write_path(plan, state, on: OnPath) -> tuple[DecodeState, Pairs]:
  """Writes an accepted path's tokens and keys/values (`commit`); returns the new pairs."""
  depth = plan.max_depth
  batch, total = state.tokens.shape
  rows = jnp.arange(batch)
  active = ~state.done
  n = state.cache.lengths
  step = state.step + 1
  num_accepted, bonus = on.num_accepted, on.bonus
  # New tokens x_{n+2}..: the accepted drafts below the root, then the bonus.
  new = jnp.concatenate([on.tokens[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
  new = new.at[rows, num_accepted].set(bonus)
  index = jnp.arange(depth + 1)[None, :]
  offered = num_accepted + 1
  eos = _is_eos(new, plan) & (index < offered[:, None])
  first_eos = jnp.min(jnp.where(eos, index, depth + 1), axis=1)
  budget = plan.max_new_tokens - state.num_generated
  kept = jnp.where(active, jnp.minimum(jnp.minimum(offered, first_eos + 1), budget), 0)
  # The root and the kept drafts but the last enter the cache; the last kept token is the bonus.
  cache = state.cache.write(_tied_to_pass(on.kv, bonus), kept)
  # Rows past `kept` write to index `total`, which mode="drop" discards.
  where = jnp.where(index < kept[:, None], n[:, None] + 1 + index, total)
  tokens = state.tokens.at[rows[:, None], where].set(new, mode="drop")
  finished = jnp.any(eos & (index < kept[:, None]), axis=1) | (kept >= budget)
  state = state.replace(
    cache=cache,
    tokens=tokens,
    step=step,
    rounds=state.rounds + active,
    accepted=state.accepted + (jnp.arange(state.accepted.shape[1])[None, :] < kept[:, None] - 1),
    done=state.done | (active & finished),
  )
  pairs = Pairs(tokens=new, features=on.features, count=kept)
  return state, pairs


def _over_valid_pairs(plan: Plan, state: DecodeState, pairs: Pairs, run):
  """`run(pairs)` (the drafter taking pairs into its cache) over the fewest leading pairs that
  hold every sequence's valid ones: the narrowest of 1, 2, 4, ... and the pairs' width, each its
  own `lax.switch` branch. A round's pairs are as wide as the plan's deepest path, and an
  adaptive tree's pending ones twice that, yet most rounds keep one or two tokens: over all 7
  pairs of `paths:0+lookup:6`, the drafter's pass made pspec's adaptive rounds pinned to
  `paths:0` cost 1.12 rounds of the fixed tree at T = 1, 1.06 over the valid ones (whole
  decodes, docs/design.md section 3.7). Only the valid pairs enter the cache and the draft, and
  a pair never sees the ones after it, so what `run` computes is the same at every width. The
  prompt's pairs (wider than a pending buffer) are taken in whole, and so are those of a drafter
  without a cache (medusa's reads the last pair alone)."""
  width = pairs.tokens.shape[1]
  widths = [w for w in (1 << i for i in range(width.bit_length())) if w < width] + [width]
  wide = width > PENDING_ROUNDS * (plan.max_depth + 1)
  if wide or state.drafter_cache is None:
    return run(pairs)

  def first(w):
    return run(Pairs(tokens=pairs.tokens[:, :w], features=pairs.features[:, :w], count=pairs.count))

  return _at_narrowest(widths, jnp.max(pairs.count), first)


def draft(
  plan: Plan, target: Target, drafter: Drafter | None, state: DecodeState, pairs: Pairs
) -> DecodeState:
  """Step 5: the drafter consumes the new pairs and drafts the next round's tree pool."""
  if drafter is None:
    return state
  context = (state.tokens, state.num_tokens)
  pool = plan.tree
  draw = _draw(plan, state)
  if pool.candidates:
    raise ValueError(
      "an adaptive tree drafts each round's candidate inside the round: run round_step"
    )
  drafter_cache, nodes = _over_valid_pairs(
    plan,
    state,
    pairs,
    lambda p: propose(drafter, target, state.drafter_cache, p, context, pool, draw),
  )
  state = state.replace(drafter_cache=drafter_cache, node_tokens=nodes[0], node_logp=nodes[1])
  return state.replace(draft_logq=nodes[2]) if draw is not None else state


def _draw(plan: Plan, state: DecodeState) -> Draw | None:
  """This round's draws from q (`Plan.drawn`), else None (top-k drafts)."""
  if not plan.drawn:
    return None
  # A stream of its own: keys derived from the rounds' keys (`accept_path` splits
  # fold_in(key, step)) could repeat one of theirs (fold_in(k, 1) is split(k)[1]), and drafts
  # that reuse the last round's random bits would follow what it accepted.
  stream = jax.random.fold_in(state.key, DRAFT_STREAM)
  return Draw(plan.sampling, jax.random.fold_in(stream, state.step))


def adaptive_rounds(
  plan: Plan,
  target: Target,
  drafter: Drafter,
  state: DecodeState,
  stop: jax.Array | None = None,
  after_round=None,
) -> DecodeState:
  """An adaptive tree's rounds until every sequence is done (or the state's step reaches
  `stop`): a loop whose body is one `lax.while_loop` per option, each running rounds of its
  option (`_option_round`) for as long as the statistics keep choosing it. A round is then its
  option's fixed round, with no switch between options around it (a switch cost the root
  alone's rounds 4-9% of a plain round on a 2-core CPU, docs/design.md section 3.7), and the
  caches stay in place: a while loop updates its buffers in place, where a branch of a switch
  that returns a cache copies it. `after_round(state)`, if given, is applied to the state each
  round leaves (`run`'s restart)."""
  pool = plan.tree
  after = after_round or (lambda s: s)

  def running(s):
    go = ~jnp.all(s.done)
    return go if stop is None else go & (s.step < stop)

  def option_loop(s, c, chain):
    def chosen(s):
      return running(s) & (s.adapt.choice == c) & (s.adapt.chain == chain)

    def body(s):
      return after(_option_round(plan, target, drafter, (c, chain), s))

    return jax.lax.while_loop(chosen, body, s)

  def each_option(s):
    for c, chain in adaptive.options(pool):
      s = option_loop(s, c, chain)
    return s

  return jax.lax.while_loop(running, each_option, state)


def _option_round(
  plan: Plan, target: Target, drafter: Drafter, option: tuple[int, bool], state: DecodeState
) -> DecodeState:
  """One round of an adaptive tree with `option`: (candidate c, whether its lookup chain is
  verified). The candidate drafts from the pending pairs (the root alone drafts nothing), is
  verified, accepted and committed as the fixed tree it is; the statistics observe what it
  verified and accepted, and choose the next round's option."""
  pool = plan.tree
  c, chain = option
  cand = pool.candidates[c] if chain else pool.candidates[c].drafted
  fixed = dataclasses.replace(plan, tree=cand, drawn=plan.drawn and cand.depth > 0)
  drafts, drafter_cache = _draft_option(plan, fixed, target, drafter, state)
  lookup = _find_chains(state, cand.lookup) if chain else None
  verified = verify(fixed, target, drafter, drafts, lookup)
  accepted = accept_path(fixed, state, verified)
  nodes = jnp.asarray(adaptive.union_nodes(pool)[c][: cand.num_nodes + cand.lookup])
  reach = jnp.zeros(accepted[1].shape + (pool.num_nodes + pool.lookup,), jnp.bool_)
  reach = reach.at[:, nodes].set(adaptive.reachable(verified.tree, cand.max_depth))
  path = _pad(nodes[accepted[0]], 1, plan.max_depth + 1)
  active = ~state.done
  ran = state.adapt.replace(choice=jnp.int32(c))  # the option run, whatever was chosen
  match = None if lookup is None else lookup[2]
  stats = adaptive.observe(ran, pool, reach, path, accepted[1], active, match)
  state, pairs = _write_path(
    fixed, state.replace(drafter_cache=drafter_cache), _on_path(verified, accepted)
  )
  state = _take_pairs(plan, fixed, target, drafter, state, pairs)
  return _constrain_state(plan, _choose_next(plan, state.replace(adapt=stats)))


def _choose_next(plan: Plan, state: DecodeState) -> DecodeState:
  """The state with the next round's option chosen (`adaptive.choose`) from its statistics
  and whether each sequence's context repeats (a lookup exists) now."""
  match = jnp.zeros(state.done.shape, jnp.int32)
  if plan.tree.lookup:
    match = _find_chains(state, 1)[2]
  choice, chain = adaptive.choose(state.adapt, plan.tree, match, ~state.done)
  return state.replace(adapt=state.adapt.replace(choice=choice, chain=chain))


def _draft_option(plan, fixed, target, drafter, state) -> tuple[DecodeState, KVCache | None]:
  """The state whose drafted nodes are option `fixed.tree`'s, drafted from the pending pairs
  (which its pass takes in), and the drafter's cache after it; the root alone drafts nothing
  and leaves the pairs pending."""
  tree = fixed.tree
  if tree.depth == 0:
    return state, state.drafter_cache
  draw = _draw(fixed, state)
  context = (state.tokens, state.num_tokens)
  cache, nodes = _over_valid_pairs(
    plan,
    state,
    state.pending,
    lambda p: propose(drafter, target, state.drafter_cache, p, context, tree, draw),
  )
  drafts = state.replace(node_tokens=nodes[0], node_logp=nodes[1])
  return (drafts.replace(draft_logq=nodes[2]) if draw is not None else drafts), cache


def _take_pairs(plan, fixed, target, drafter, state, pairs: Pairs) -> DecodeState:
  """The state with a round's new pairs pending. A drafter without a cache reads the last
  round's pairs alone. A drafter with one took the pending pairs in with its pass if the round
  drafted; a round that did not adds its pairs to them (`_fed` takes them in once the buffer is
  full)."""
  empty = state.pending.replace(count=jnp.zeros_like(state.pending.count))
  if state.drafter_cache is None or fixed.tree.depth > 0:
    return state.replace(pending=_merged(empty, pairs))
  return _fed(plan, target, drafter, state.replace(pending=_merged(state.pending, pairs)))


def _fed(plan: Plan, target: Target, drafter: Drafter, state: DecodeState) -> DecodeState:
  """The state with the pending pairs taken into the drafter's cache if the buffer has no room
  left for the widest round's. A `lax.while_loop` that runs once or not at all, not a
  `lax.cond`: a cond returning the cache copied it every round, where a loop updates its
  buffers in place (pspec's root-alone rounds on a 2-core CPU: 1.16-1.18 plain rounds with the
  cond, 1.05-1.08 with the loop; docs/design.md section 3.7)."""
  width = state.pending.tokens.shape[1]

  def full(s):
    return jnp.max(s.pending.count) > width - (plan.max_depth + 1)

  def take_in(s):
    run = lambda p: feed(drafter, target, s.drafter_cache, p)
    cache = _over_valid_pairs(plan, s, s.pending, run)
    return s.replace(
      drafter_cache=cache, pending=s.pending.replace(count=jnp.zeros_like(s.pending.count))
    )

  return jax.lax.while_loop(full, take_in, state)


def _merged(pending: Pairs, pairs: Pairs) -> Pairs:
  """`pairs` after the `pending` ones, in the pending buffer's width."""
  width, new = pending.tokens.shape[1], pairs.tokens.shape[1]
  j = jnp.arange(width)[None, :]
  after = j >= pending.count[:, None]
  source = jnp.clip(j - pending.count[:, None], 0, new - 1)
  return Pairs(
    tokens=jnp.where(after, take_rows(pairs.tokens, source), pending.tokens),
    features=jnp.where(after[..., None], take_rows(pairs.features, source), pending.features),
    count=pending.count + pairs.count,
  )


def _init_adaptive(plan, target, drafter, state, pairs: Pairs) -> DecodeState:
  """An adaptive tree's state after the prefill: the prompt's pairs but the last in the
  drafter's cache (if it has one), the last pending (the first round drafts from it), and the
  first round's option chosen."""
  batch = state.tokens.shape[0]
  rows = PENDING_ROUNDS * (plan.max_depth + 1)
  empty = Pairs(
    tokens=jnp.zeros((batch, rows), jnp.int32),
    features=jnp.zeros((batch, rows, pairs.features.shape[-1]), pairs.features.dtype),
    count=jnp.zeros((batch,), jnp.int32),
  )
  last = Pairs(
    tokens=pairs.last(pairs.tokens),
    features=pairs.last(pairs.features),
    count=jnp.ones_like(pairs.count),
  )
  cache = state.drafter_cache
  if cache is not None:
    cache = feed(drafter, target, cache, pairs.replace(count=pairs.count - 1))
  return _choose_next(plan, state.replace(drafter_cache=cache, pending=_merged(empty, last)))


def round_step(
  plan: Plan, target: Target, drafter: Drafter | None, state: DecodeState
) -> DecodeState:
  """One round: verify the drafted tree, accept and commit, draft the next tree (an adaptive
  tree's round drafts its candidate first, `_option_round`)."""
  if plan.tree.candidates:
    return adaptive_rounds(plan, target, drafter, state, stop=state.step + 1)
  if plan.tree.lookup:
    state, pairs = _round_lookup(plan, target, drafter, state)
  else:
    state, pairs = commit(plan, state, verify(plan, target, drafter, state))
  return _constrain_state(plan, draft(plan, target, drafter, state, pairs))


def run(
  plan: Plan,
  target: Target,
  drafter: Drafter | None,
  state: DecodeState,
  stop: jax.Array | None = None,
  restart: jax.Array | None = None,
) -> DecodeState:
  """Rounds until every sequence is done, or the state's step reaches `stop`: `decode.generate`'s
  loop.

  `restart` (a bool scalar): while true, every round starts from `state` again, only the caches'
  buffers (updated in place) and the step carried, so every round is the same round:
  `infer.calibration` times an adaptive tree's rounds so, in the very program that decodes
  (false when decoding: a select of the state's small arrays each round)."""
  after = _restarted(state, restart)
  if plan.tree.candidates:
    return adaptive_rounds(plan, target, drafter, state, stop, after_round=after)

  def running(s):
    go = ~jnp.all(s.done)
    return go if stop is None else go & (s.step < stop)

  return jax.lax.while_loop(running, lambda s: after(round_step(plan, target, drafter, s)), state)


def _restarted(start: DecodeState, restart: jax.Array | None):
  """`state -> state` that, where `restart` holds, puts back everything of `start` but the caches'
  buffers and the step (the identity without `restart`)."""
  if restart is None:
    return lambda s: s

  def after(s):
    small = lambda x: without_buffers(x).replace(step=None)
    fresh = jax.tree.map(lambda a, b: jnp.where(restart, a, b), small(start), small(s))
    return with_buffers(fresh, s).replace(step=s.step)

  return after


def without_buffers(state: DecodeState) -> DecodeState:
  """`state` without its caches' key/value buffers (None in their place)."""

  def unbuffered(cache):
    return None if cache is None else cache.replace(k=None, v=None)

  return state.replace(cache=unbuffered(state.cache), drafter_cache=unbuffered(state.drafter_cache))


def with_buffers(state: DecodeState, carried: DecodeState) -> DecodeState:
  """`state` with the caches' key/value buffers of `carried`."""

  def buffered(cache, source):
    return None if cache is None else cache.replace(k=source.k, v=source.v)

  return state.replace(
    cache=buffered(state.cache, carried.cache),
    drafter_cache=buffered(state.drafter_cache, carried.drafter_cache),
  )
