"""Drafting a round's token tree with a drafter (`drafter.py`; docs/design.md sections 3.2 and 3.3).

Each round `propose` consumes the pairs accepted since the last round (the last one holds the
bonus token) and returns a token and a draft log-probability for every node of the tree pool.
`pspec` and `eagle` keep a KV cache over real pairs (one layer per drafter layer); mask slots
and tree nodes never enter it.

Drafts drawn from q (`propose` with a `Draw`, sampling at T > 0): instead of the top-k tokens,
each pool node's children are drawn from the drafter's distribution q there (filtered like the
target's: temperature, top-k, top-p) without replacement, by Gumbel-top-k, a node's r-th child
being the r-th draw (`sibling_order`); every parent draws independently. q is the depth's for
pspec and medusa (their distribution at a depth does not depend on the tokens above it) and
the parent's own for eagle. A drawn node's confidence (`node_logp`, what dynamic trees rank and
gates cut by) is the log q of the most probable token not drawn before it among its siblings:
the q path product EAGLE-2 ranks by, taken before the node is drawn. It must not depend on the
drawn token: a tree that kept a drawn node because of its own q would keep likely drafts more
often than q draws them, and recursive rejection sampling, which assumes q, would no longer give
the target's distribution.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pspec_jax import sampling
from pspec_jax import tree as tree_lib
from pspec_jax.arrays import take_rows
from pspec_jax.drafter import Drafter, FeatureDrafter
from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Target
from pspec_jax.sampling import SamplingConfig, filtered_logits

__all__ = [
  "PROPOSERS",
  "Draw",
  "Pairs",
  "draw_candidates",
  "draw_tables",
  "feed",
  "pld_candidates",
  "propose",
  "pspec_mask",
  "sibling_order",
]


@struct.dataclass
class Pairs:
  """Drafter pairs accepted since the last round: pair i is (h_t, x_{t+1}), t = start + i."""

  tokens: jax.Array  # [B, R] x_{t+1}
  features: jax.Array  # [B, R, E] h_t, the target feature the drafter reads (`read_target`)
  count: jax.Array  # [B] valid pairs (the last one holds the bonus token)

  def last(self, x_BR):
    """The entry of the last valid pair, per sequence: [B, 1, ...]."""
    return take_rows(x_BR, jnp.maximum(self.count - 1, 0)[:, None])


def pspec_mask(count_B: jax.Array, num_real: int, num_slots: int) -> jax.Array:
  """[B, T, T] attention of `num_real` pairs followed by `num_slots` mask slots.

  Real pairs are causal among themselves and never see slots; slot d sees the valid real
  pairs (those before `count`, i.e. positions <= the anchor) and the slots d' <= d.
  """
  t = num_real + num_slots
  i = jnp.arange(t)[:, None]
  j = jnp.arange(t)[None, :]
  real_key = (j < num_real)[None]
  slot_sees_real = (j[None] < count_B[:, None, None]) & (i >= num_real)[None]
  real_sees_real = ((j <= i) & (i < num_real))[None]
  return jnp.where(real_key, slot_sees_real | real_sees_real, (j <= i) & (i >= num_real))


@dataclasses.dataclass(frozen=True)
class Draw:
  """Draw the tree from q (see the module docstring): the sampling settings and this round's
  PRNG key."""

  sampling: SamplingConfig
  key: jax.Array

  def logq(self, drafter: Drafter, target: Target, g_XD: jax.Array) -> jax.Array:
    """log q [..., V'] over the draft vocabulary, filtered like the target's distribution."""
    logits = filtered_logits(drafter.logits(target, g_XD), self.sampling)
    return jax.nn.log_softmax(logits, axis=-1)


def draw_candidates(logq_XV: jax.Array, num_candidates: int, key: jax.Array):
  """`num_candidates` draws from each row of q, without replacement (`sampling.draws`): distinct
  while q has tokens left.

  Returns:
    (index [..., k], score [..., k]): the draws (indices into the row) in the order drawn, and
    for rank r the log q of the most probable index not among draws 0..r-1 (never below the
    draw's own log q; it reads the draws before rank r only).
  """
  k = num_candidates
  index = sampling.draws(key, logq_XV, k)
  top_logq, top_index = jax.lax.top_k(logq_XV, k)
  before = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]  # [rank, j]: draw j precedes rank
  # [..., rank, t]: q's t-th most probable index was drawn before rank.
  drawn = (top_index[..., None, :, None] == index[..., None, None, :]) & before[:, None, :]
  score = jnp.max(jnp.where(drawn.any(-1), -jnp.inf, top_logq[..., None, :]), axis=-1)
  return index.astype(jnp.int32), score


def draw_tables(kind: str, pool: tree_lib.Tree) -> np.ndarray:
  """[M] the row of `propose`'s draft distributions that each pool node is drawn from: its depth's
  (pspec, medusa) or its parent's (eagle; rows are the pool nodes above the deepest level, in
  node order). The root is not drawn: -1."""
  a = pool.arrays
  table = a.parent.copy() if kind == "eagle" else a.depth - 1
  table[0] = -1
  return table.astype(np.int32)


def sibling_order(pool: tree_lib.Tree) -> np.ndarray:
  """[M] each node's place among its siblings (0 for the root): the draw it takes. A static
  tree may skip ranks (`paths:0/2`); drawn from q, its siblings are still the first draws, in
  order, as recursive rejection sampling assumes of the siblings it tries."""
  children = pool.arrays.children
  order = np.zeros(pool.num_nodes, np.int32)
  for kids in children:
    order[kids[kids >= 0]] = np.arange((kids >= 0).sum())
  return order


def _full_vocab(drafter: Drafter, target: Target, logq_XV: jax.Array) -> jax.Array:
  """log q over the target's vocabulary: -inf outside a restricted draft vocabulary."""
  if drafter.vocab is None:
    return logq_XV
  full = jnp.full((*logq_XV.shape[:-1], target.cfg.vocab_size), -jnp.inf, logq_XV.dtype)
  return full.at[..., drafter.vocab].set(logq_XV)


def _drawn_nodes(drafter, target, logq_BGV, pool, draw: Draw):
  """Every pool node drawn from row `draw_tables` of q, independently per parent: (tokens,
  scores, log q over the target's vocabulary)."""
  a = pool.arrays
  parents = np.arange(int((a.depth < pool.depth).sum()))  # the nodes above the deepest level
  rows = draw_tables(drafter.cfg.kind, pool)
  # The row a parent's children come from: any child's (parents without children draw unused).
  parent_row = np.zeros(len(parents), np.int32)
  parent_row[a.parent[1:]] = rows[1:]
  index, score = draw_candidates(logq_BGV[:, parent_row], pool.num_candidates, draw.key)
  order = sibling_order(pool)[1:]
  tokens = drafter.token_ids(index[:, a.parent[1:], order]).astype(jnp.int32)
  batch = logq_BGV.shape[0]
  return (
    jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tokens], axis=1),
    jnp.concatenate([jnp.zeros((batch, 1)), score[:, a.parent[1:], order]], axis=1),
    _full_vocab(drafter, target, logq_BGV),
  )


def _top_candidates(drafter: Drafter, target: Target, g_BPD, num_candidates):
  """Top tokens and their draft log-probabilities at every depth: [B, P, k] each."""
  logp = jax.nn.log_softmax(drafter.logits(target, g_BPD), axis=-1)
  logp_k, index_k = jax.lax.top_k(logp, num_candidates)
  return drafter.token_ids(index_k).astype(jnp.int32), logp_k


def _nodes_from_candidates(tokens_BPk, logp_BPk, pool: tree_lib.Tree):
  """Node m at depth d and rank r takes candidate r of depth d; missing ranks are -inf."""
  a = pool.arrays
  depth, rank = a.depth[1:] - 1, a.rank[1:]
  have = tokens_BPk.shape[-1]
  tokens = tokens_BPk[:, depth, jnp.minimum(rank, have - 1)]
  logp = jnp.where(rank < have, logp_BPk[:, depth, jnp.minimum(rank, have - 1)], -jnp.inf)
  batch = tokens_BPk.shape[0]
  zero = jnp.zeros((batch, 1))
  return (
    jnp.concatenate([zero.astype(jnp.int32), tokens], axis=1),
    jnp.concatenate([zero, logp], axis=1),
  )


def _propose_pspec(drafter, target, cache, pairs, context, pool, draw: Draw | None = None):
  depth = pool.depth
  num_real = pairs.tokens.shape[1]
  u = drafter.apply(target.embed(pairs.tokens), pairs.features, method=FeatureDrafter.pairs)
  slots = drafter.apply(method=FeatureDrafter.slots)[: depth - 1]
  batch = u.shape[0]
  x = jnp.concatenate([u, jnp.broadcast_to(slots, (batch, *slots.shape)).astype(u.dtype)], 1)
  start = cache.lengths[:, None]
  anchor = start + pairs.count[:, None] - 1
  positions = jnp.concatenate([start + jnp.arange(num_real), anchor + jnp.arange(1, depth)], axis=1)
  g, (k, v) = drafter.apply(x, positions, pspec_mask(pairs.count, num_real, depth - 1), cache)
  cache = cache.write((k[:, :, :num_real], v[:, :, :num_real]), pairs.count)
  g_BPD = jnp.concatenate([pairs.last(g[:, :num_real]), g[:, num_real:]], axis=1)
  if draw is not None:
    return cache, _drawn_nodes(drafter, target, draw.logq(drafter, target, g_BPD), pool, draw)
  candidates = _top_candidates(drafter, target, g_BPD, pool.num_candidates)
  return cache, _nodes_from_candidates(*candidates, pool)


def _propose_eagle(drafter, target, cache, pairs, context, pool, draw: Draw | None = None):
  """Real pairs first (into the cache), then the pool level by level.

  Pass d runs every node of depth <= d under the tree mask (a node sees its ancestors and the
  real pairs); recomputing the shallower levels keeps one layer call per level without a
  scratch cache, and costs little at tree sizes. Drawn from q, each level's parents draw their
  children from their own q, with the level's key.
  """
  a, k = pool.arrays, pool.num_candidates
  num_real = pairs.tokens.shape[1]
  u = drafter.apply(target.embed(pairs.tokens), pairs.features, method=FeatureDrafter.pairs)
  start = cache.lengths[:, None]
  causal = jnp.tril(jnp.ones((num_real, num_real), jnp.bool_))
  g, kv = drafter.apply(u, start + jnp.arange(num_real), causal, cache)
  cache = cache.write(kv, pairs.count)
  anchor = start + pairs.count[:, None] - 1
  batch, m = u.shape[0], pool.num_nodes
  node_g = jnp.zeros((batch, m, u.shape[-1]), g.dtype).at[:, :1].set(pairs.last(g))
  node_tokens = jnp.zeros((batch, m), jnp.int32)
  node_logp = jnp.zeros((batch, m), jnp.float32)
  logq = []  # drawn from q: every level's parents' log q, in node order
  for d in range(pool.depth):
    # Children of the depth-d nodes (their g is known) take their parent's top-k (or draws).
    parents = (a.depth == d).nonzero()[0]
    children = (a.depth == d + 1).nonzero()[0]
    if draw is None:
      tokens_k, logp_k = _top_candidates(drafter, target, node_g[:, parents], k)
    else:
      logq.append(draw.logq(drafter, target, node_g[:, parents]))
      index_k, logp_k = draw_candidates(logq[-1], k, jax.random.fold_in(draw.key, d))
      tokens_k = drafter.token_ids(index_k).astype(jnp.int32)
    slot = a.parent[children] - parents[0]
    rank = a.rank[children] if draw is None else sibling_order(pool)[children]
    node_tokens = node_tokens.at[:, children].set(tokens_k[:, slot, rank])
    node_logp = node_logp.at[:, children].set(logp_k[:, slot, rank])
    if d + 1 == pool.depth:
      break
    nodes = np.arange(1, children[-1] + 1)
    # g of the parent stands in for the next target feature, in the drafter's width.
    u = drafter.apply(
      target.embed(node_tokens[:, nodes]),
      node_g[:, a.parent[nodes]],
      method=FeatureDrafter.fuse_pairs,
    )
    mask = a.ancestors[1:, 1:][: len(nodes), : len(nodes)]
    g, _ = drafter.apply(u, anchor + a.depth[nodes], mask, cache)
    node_g = node_g.at[:, children].set(g[:, children - 1])
  if draw is not None:
    logq_BGV = _full_vocab(drafter, target, jnp.concatenate(logq, axis=1))
    return cache, (node_tokens, node_logp, logq_BGV)
  return cache, (node_tokens, node_logp)


def _propose_medusa(drafter, target, cache, pairs, context, pool, draw: Draw | None = None):
  h_BPD = drafter.apply(pairs.last(pairs.features)[:, 0])[:, : pool.depth]
  if draw is not None:
    return cache, _drawn_nodes(drafter, target, draw.logq(drafter, target, h_BPD), pool, draw)
  candidates = _top_candidates(drafter, target, h_BPD, pool.num_candidates)
  return cache, _nodes_from_candidates(*candidates, pool)


def pld_candidates(tokens_BW, num_tokens_B, num_draft, max_ngram, min_ngram=1, max_match=8):
  """Prompt lookup: the K tokens after the most recent earlier occurrence of the suffix.

  The longest suffix n-gram (`max_ngram` down to `min_ngram`) with an earlier occurrence wins;
  among its occurrences the most recent. A continuation that reaches the end of the known
  tokens starts over from its own beginning: the q tokens between the occurrence and the end
  are taken as a loop of period q (`1 1 1` continues `1 1 ...`, `a b a b` continues `a b ...`).
  Returns tokens [B, K], whether each is a real proposal (all of them when a match exists), and
  [B] how many tokens the match runs back from the suffix's end, up to `max_match` (0: none
  found): a measure of how sure the chain is (a copied line matches far back).
  """
  width = tokens_BW.shape[1]
  starts = jnp.arange(width)

  def one(tokens_W, n):
    best_start, found = jnp.int32(-1), jnp.bool_(False)
    for g in range(max_ngram, min_ngram - 1, -1):
      suffix = jax.lax.dynamic_slice(tokens_W, (jnp.maximum(n - g, 0),), (g,))
      same = jnp.ones((width,), jnp.bool_)
      for j in range(g):
        shifted = jnp.roll(tokens_W, -j)
        same = same & (shifted == suffix[j])
      # An occurrence must end before the suffix's last token so that a continuation exists.
      valid = same & (starts + g <= n - 1) & (n - g >= 0)
      last = jnp.max(jnp.where(valid, starts, -1))
      take = ~found & (last >= 0)
      best_start = jnp.where(take, last + g, best_start)
      found = found | take
    period = jnp.maximum(n - best_start, 1)
    index = best_start + jnp.arange(num_draft) % period
    ok = jnp.broadcast_to(found, (num_draft,))
    back = jnp.arange(1, max_match + 1)
    at = best_start - back
    same = (tokens_W[jnp.clip(at, 0, width - 1)] == tokens_W[jnp.clip(n - back, 0, width - 1)]) & (
      at >= 0
    )
    match = jnp.where(found, jnp.sum(jnp.cumprod(same.astype(jnp.int32))), 0)
    return tokens_W[jnp.clip(index, 0, width - 1)], ok, match.astype(jnp.int32)

  return jax.vmap(one)(tokens_BW, num_tokens_B)


def _propose_pld(drafter, target, cache, pairs, context, pool):
  tokens_BW, num_tokens_B = context
  tokens, ok, _ = pld_candidates(tokens_BW, num_tokens_B, pool.depth, drafter.cfg.max_ngram)
  logp = jnp.where(ok, 0.0, -jnp.inf)
  return cache, _nodes_from_candidates(tokens[..., None], logp[..., None], pool)


def feed(drafter: Drafter, target: Target, cache: KVCache | None, pairs: Pairs):
  """The drafter's cache after taking in `pairs`, with nothing drafted (a round that verifies
  the root alone); the keys/values are those `propose` writes (real pairs never see slots)."""
  if cache is None:
    return None
  u = drafter.apply(target.embed(pairs.tokens), pairs.features, method=FeatureDrafter.pairs)
  num_real = pairs.tokens.shape[1]
  causal = jnp.tril(jnp.ones((num_real, num_real), jnp.bool_))
  _, kv = drafter.apply(u, cache.lengths[:, None] + jnp.arange(num_real), causal, cache)
  return cache.write(kv, pairs.count)


def propose(
  drafter: Drafter,
  target: Target,
  cache: KVCache | None,
  pairs: Pairs,
  context: tuple[jax.Array, jax.Array],
  pool: tree_lib.Tree,
  draw: Draw | None = None,
):
  """Drafts every node of the tree pool for the next round.

  Args:
    drafter: the drafter.
    target: the target (its embedding and LM head are shared).
    cache: the drafter's cache over real pairs before `pairs` (None for medusa/pld).
    pairs: the pairs accepted since the last round.
    context: (tokens_BW, num_tokens_B): every sequence's known tokens, bonus included.
    pool: the tree (or dynamic pool) to fill.
    draw: draw the nodes from q (pspec, eagle, medusa; the module docstring); None: top-k.

  Returns:
    (cache, (node_tokens_BM, node_logp_BM)): the updated drafter cache, and each pool node's
    token and its draft log-probability given its parent (root entries are placeholders).
    Drawn from q, node_logp is the node's confidence (the module docstring) and a third entry
    is added: log q over the target's vocabulary [B, G, V], row `draw_tables(kind, pool)[m]`
    being the distribution node m was drawn from.
  """
  if pool.depth == 0:
    batch = pairs.count.shape[0]
    return cache, (jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, 1)))
  if draw is not None:
    if drafter.cfg.kind == "pld":
      raise ValueError("prompt lookup has no distribution to draw a tree from")
    return PROPOSERS[drafter.cfg.kind](drafter, target, cache, pairs, context, pool, draw)
  return PROPOSERS[drafter.cfg.kind](drafter, target, cache, pairs, context, pool)


# kind -> fn(drafter, target, cache, pairs, context, pool[, draw]) -> (cache, (node_tokens,
# node_logp[, logq])); pld takes no draw.
PROPOSERS = {
  "pspec": _propose_pspec,
  "eagle": _propose_eagle,
  "medusa": _propose_medusa,
  "pld": _propose_pld,
}
