"""Drafters: what proposes the token tree each round (docs/design.md sections 2 and 5).

Every kind reads the target through its features f_t and shares the target's embedding and LM
head (passed in at apply time, never part of the drafter's parameters):

- `pspec`: pair t is u_t = Fuse([embed(x_{t+1}); f_t]) at position t; one decoder layer (the
  target's block, its own width settings) and a norm give g_t, whose logits W·g_t predict
  x_{t+2}. K-1 learned mask vectors m_d are appended after the last real pair a, at positions
  a + d; slot (a, d) sees the real pairs up to a and the slots (a, d' <= d), and predicts
  x_{a+d+2}. One pass proposes x_{a+2} .. x_{a+K+1}.
- `eagle`: the same layer run auto-regressively (EAGLE-1): g_t also stands in for f_{t+1}, so a
  tree node's pair is (g of its parent, its token); the tree is drafted level by level.
- `medusa`: K residual heads on the last feature; head d predicts x_{t+d+1} from f_t.
- `pld`: prompt lookup, no parameters: the continuation of the longest most recent n-gram
  match of the sequence's suffix. Decoded with a drafted tree (`chain`) it is verified every
  round; the command-line default, the tree `lookup`, verifies it only in rounds with a match
  (the same lookup chain any drafter's tree can add, `tree.py`).

Each round `propose` consumes the pairs accepted since the last round (the last one holds the
bonus token) and returns a token and a draft log-probability for every node of the tree pool.
`pspec` and `eagle` keep a one-layer KV cache over real pairs; mask slots and tree nodes never
enter it.

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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pspec_jax import llama, panels
from pspec_jax import tree as tree_lib
from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Block, LlamaConfig, RMSNorm, RopeScaling, Target, _param
from pspec_jax.sampling import SamplingConfig, filtered_logits

KINDS = ("pspec", "eagle", "medusa", "pld")
Dtype = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
  """A drafter's kind, draft length, decoder-layer widths and the target it was built for.

  Attributes:
    kind: one of KINDS.
    num_draft: K, the draft tokens per round it was built for (pspec: K-1 mask vectors;
      medusa: K heads). Decoding may use fewer.
    tree: the tree preset it is meant to decode with (`tree.parse`), greedy.
    sampling_tree: the tree it decodes with at temperature > 0; "" is `tree`. Sampled drafts
      are accepted less often than greedy ones, so a smaller tree (or prompt lookup alone)
      can be the faster one there.
    adaptive: the candidate trees (`A|B|...`) the tree `adaptive` chooses from each round;
      "" is `tree.ADAPTIVE`.
    target_name, vocab_size, hidden_size: identity of the target (checked at load time).
    num_heads, num_kv_heads, head_dim, intermediate_size: the drafter layer's widths.
    rope_theta, rope_scaling, rms_norm_eps: as the target's.
    max_ngram: pld's longest n-gram.
    draft_vocab_size: V', the tokens the drafter can propose (the most frequent ones of its
      training data, stored with it); 0 means the target's whole vocabulary. A smaller draft
      vocabulary makes the drafter's LM head (the target's, restricted to those rows) cheaper.
    weight_layout: how its dense weights are stored (`LlamaConfig.weight_layout`): the
      target's, chosen when the target is loaded; never written to a drafter file.
  """

  kind: str
  num_draft: int = 4
  tree: str = "chain"
  sampling_tree: str = ""
  adaptive: str = ""
  target_name: str
  vocab_size: int
  hidden_size: int
  num_heads: int = 1
  num_kv_heads: int = 1
  head_dim: int = 0
  intermediate_size: int = 1
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  max_ngram: int = 3
  draft_vocab_size: int = 0
  weight_layout: str = "plain"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown drafter kind {self.kind!r}: use one of {', '.join(KINDS)}")
    if self.num_draft < 1:
      raise ValueError(f"DrafterConfig.num_draft (K) must be >= 1, got {self.num_draft}")
    if self.max_ngram < 1:
      raise ValueError(f"DrafterConfig.max_ngram must be >= 1, got {self.max_ngram}")
    if not 0 <= self.draft_vocab_size <= self.vocab_size:
      raise ValueError(
        f"DrafterConfig.draft_vocab_size must be in [0, {self.vocab_size}], "
        f"got {self.draft_vocab_size}"
      )
    for tree in (self.tree, self.sampling_tree, self.adaptive and "adaptive"):
      if tree:  # fails early on an unknown preset
        tree_lib.parse(self.resolve_tree(tree), self.num_draft)

  @classmethod
  def for_target(cls, kind: str, target: LlamaConfig, **overrides) -> "DrafterConfig":
    """A drafter whose layer has the target's block widths."""
    settings = dict(
      kind=kind,
      target_name=target.name,
      vocab_size=target.vocab_size,
      hidden_size=target.hidden_size,
      num_heads=target.num_heads,
      num_kv_heads=target.num_kv_heads,
      head_dim=target.head_dim,
      intermediate_size=target.intermediate_size,
      rope_theta=target.rope_theta,
      rope_scaling=target.rope_scaling,
      rms_norm_eps=target.rms_norm_eps,
      weight_layout=target.weight_layout,
      dtype=target.dtype,
      param_dtype=target.param_dtype,
    )
    return cls(**(settings | overrides))

  @property
  def layer(self) -> LlamaConfig:
    """The decoder layer's config (the target's block type)."""
    return LlamaConfig(
      name=f"{self.kind}-drafter",
      vocab_size=self.vocab_size,
      hidden_size=self.hidden_size,
      intermediate_size=self.intermediate_size,
      num_layers=1,
      num_heads=self.num_heads,
      num_kv_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      rope_theta=self.rope_theta,
      rope_scaling=self.rope_scaling,
      rms_norm_eps=self.rms_norm_eps,
      scan_layers=False,
      weight_layout=self.weight_layout,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
    )

  def replace(self, **changes) -> "DrafterConfig":
    return dataclasses.replace(self, **changes)

  def tree_for(self, greedy: bool) -> str:
    """The tree this drafter decodes with, greedy or sampling."""
    return self.tree if greedy else self.sampling_tree or self.tree

  def resolve_tree(self, tree: str) -> str:
    """`tree` with `adaptive` spelled out as this drafter's candidate set."""
    if tree == "adaptive" and self.adaptive:
      return f"adaptive:{self.adaptive}"
    return tree


class FeatureDrafter(nn.Module):
  """`pspec` and `eagle`: Fuse([embed(x_{t+1}); f_t]) -> one decoder layer -> norm."""

  cfg: DrafterConfig

  def setup(self):
    cfg, d = self.cfg, self.cfg.hidden_size
    init = nn.initializers.normal(0.02)
    self.fuse = llama.dense_param(self, "fuse", (2 * d,), (d,), ("fused", "embed"), cfg.layer)
    self.block = Block(cfg.layer)
    self.norm = RMSNorm(cfg.layer)
    if cfg.kind == "pspec":
      slots = (max(cfg.num_draft - 1, 1), d)
      self.mask_slots = _param(self, "mask_slots", init, slots, ("draft", "embed"), cfg.param_dtype)

  def pairs(self, embeds_BTD, features_BTD):
    """u_t = Fuse([embed(x_{t+1}); f_t])."""
    dt = self.cfg.dtype
    x = jnp.concatenate([embeds_BTD.astype(dt), features_BTD.astype(dt)], axis=-1)
    return llama.dense(self.cfg.layer, x, self.fuse, self.cfg.hidden_size)

  def slots(self):
    """The learned mask vectors m_1..m_{K-1}."""
    return self.mask_slots.astype(self.cfg.dtype)

  def __call__(self, x_BTD, positions_BT, mask_BTT, cache: KVCache):
    """g_BTD (normed: the LM-head input) and the new keys/values [1, B, T, K, H]."""
    layer_kv = cache.layer(0)
    mask_BTT = jnp.broadcast_to(mask_BTT, (x_BTD.shape[0], *mask_BTT.shape[-2:]))
    x_BTD, (k, v) = self.block(x_BTD, layer_kv, positions_BT, mask_BTT, cache.lengths)
    return self.norm(x_BTD), (k[None], v[None])

  def train_forward(self, embeds_BTD, features_BTD, positions_BT, mask_BTT, slots=None):
    """The training layout: real pairs, then (pspec) the mask-slot groups.

    Args:
      embeds_BTD, features_BTD: pair t is (embed(x[t+1]), f[t]).
      positions_BT, mask_BTT: the pairs' RoPE positions and attention (causal within each
        packed conversation).
      slots: a `losses.SlotLayout` (pspec), or None for the real pairs alone.

    Returns:
      (g_BTD, g_BAPD or None): normed drafter features of the pairs and of the slots.
    """
    u = self.pairs(embeds_BTD, features_BTD)
    x, kv = self.block(u, None, positions_BT, mask_BTT, None)
    if slots is None:
      return self.norm(x), None
    b, a, p = slots.positions.shape
    m = jnp.broadcast_to(self.slots()[:p], (b, a, p, u.shape[-1]))
    keys = jnp.arange(u.shape[1])
    sees_BAT = (keys >= slots.first[..., None]) & (keys < slots.visible[..., None])
    y = self.block.grouped(m, slots.positions, kv, sees_BAT)
    return self.norm(x), self.norm(y)

  def init_all(self, features_BTD):
    """Touches every parameter (for `init`)."""
    u = self.pairs(features_BTD, features_BTD)
    if self.cfg.kind == "pspec":
      u = u + self.slots()[0]
    positions = jnp.zeros(u.shape[:2], jnp.int32)
    mask = jnp.ones((1, u.shape[1], u.shape[1]), jnp.bool_)
    return self.norm(self.block(u, None, positions, mask, None)[0])


class MedusaHeads(nn.Module):
  """`medusa`: head d maps f_t to f_t + SiLU(W_d f_t + b_d), read by the target's LM head."""

  cfg: DrafterConfig

  @nn.compact
  def __call__(self, features_BD):
    cfg, d, k = self.cfg, self.cfg.hidden_size, self.cfg.num_draft
    init = nn.initializers.normal(0.02)
    w = _param(self, "w", init, (k, d, d), ("draft", "embed", "mlp"), cfg.param_dtype)
    b = _param(self, "b", nn.initializers.zeros, (k, d), ("draft", "mlp"), cfg.param_dtype)
    f = features_BD.astype(cfg.dtype)
    h = jnp.einsum("BD,PDE->BPE", f, w.astype(cfg.dtype)) + b.astype(cfg.dtype)
    return f[:, None, :] + nn.silu(h)


def module(cfg: DrafterConfig) -> nn.Module:
  return MedusaHeads(cfg) if cfg.kind == "medusa" else FeatureDrafter(cfg)


def init_boxed(cfg: DrafterConfig, key: jax.Array) -> dict:
  """Random parameters, each boxed with its logical axis names; `pld` has none."""
  if cfg.kind == "pld":
    return {}
  features = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
  if cfg.kind == "medusa":
    return MedusaHeads(cfg).init(key, features[:, 0])["params"]
  return FeatureDrafter(cfg).init(key, features, method=FeatureDrafter.init_all)["params"]


def init_params(cfg: DrafterConfig, key: jax.Array) -> dict:
  """Random parameters (an untrained drafter); `pld` has none."""
  return nn.meta.unbox(init_boxed(cfg, key))


@struct.dataclass
class Drafter:
  """A drafter: its (static) config and its parameters, passable through `jax.jit`.

  `vocab` holds the token ids of a restricted draft vocabulary ([V'] int32, None for the whole
  vocabulary); `head` is the target's LM head restricted to them ([V', D], or in the panel
  layout the packed [D, V']), derived once per decode by `with_head` (never stored: the LM
  head is the target's).
  """

  cfg: DrafterConfig = struct.field(pytree_node=False)
  params: Any
  vocab: jax.Array | None = None
  head: jax.Array | None = None

  def with_head(self, target: Target) -> "Drafter":
    """The drafter with its restricted LM head gathered from the target (once, not per round)."""
    if self.vocab is None or self.head is not None:
      return self
    return self.replace(head=self._gather_head(target))

  def _gather_head(self, target: Target) -> jax.Array:
    """The restricted head: [V', D] rows, or in panels the [D, V'] matrix (`weight_layout`)."""
    rows_VD = target.head_rows(self.vocab)
    return panels.pack(rows_VD.T) if self.cfg.weight_layout == "panels" else rows_VD

  def logits(self, target: Target, g_XD: jax.Array) -> jax.Array:
    """Float32 draft logits over the draft vocabulary (the target's LM head on g)."""
    if self.vocab is None:
      return target.logits(g_XD)
    head = self.head if self.head is not None else self._gather_head(target)
    if self.cfg.weight_layout == "panels":
      return llama.dense(self.cfg.layer, g_XD, head, self.cfg.draft_vocab_size, jnp.float32)
    f32 = dict(preferred_element_type=jnp.float32)
    return jnp.einsum("...D,VD->...V", g_XD.astype(head.dtype), head, **f32)

  def with_weight_layout(self, layout: str) -> "Drafter":
    """The same drafter with its dense weights stored in `layout` (`panels.LAYOUTS`)."""
    if layout == self.cfg.weight_layout:
      return self
    plain = self.cfg.replace(weight_layout="plain")
    shapes = jax.eval_shape(lambda: init_params(plain, jax.random.key(0)))
    params = llama.relayout(self.params, layout, shapes)
    return self.replace(cfg=self.cfg.replace(weight_layout=layout), params=params)

  def token_ids(self, index_X: jax.Array) -> jax.Array:
    """Token ids of draft-vocabulary indices."""
    return index_X if self.vocab is None else jnp.take(self.vocab, index_X)

  def apply(self, *args, method=None):
    return module(self.cfg).apply({"params": self.params}, *args, method=method)

  def empty_cache(self, batch: int, max_len: int) -> KVCache | None:
    """The drafter's own cache over real pairs (None for kinds without one)."""
    if self.cfg.kind not in ("pspec", "eagle"):
      return None
    layer = self.cfg.layer
    return KVCache.zeros(
      num_layers=1,
      batch=batch,
      max_len=max_len,
      num_kv_heads=layer.num_kv_heads,
      head_dim=layer.head_dim,
      dtype=layer.dtype,
    )


def random_drafter(kind: str, target: Target, key: jax.Array, **overrides) -> Drafter:
  """An untrained drafter of `kind` for `target` (seeded by `key`); a restricted draft
  vocabulary is the first `draft_vocab_size` token ids."""
  cfg = DrafterConfig.for_target(kind, target.cfg, **overrides)
  vocab = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) if cfg.draft_vocab_size else None
  # Drawn in the plain layout, so a seed gives the same drafter in every layout.
  plain = cfg.replace(weight_layout="plain")
  drafter = Drafter(cfg=plain, params=init_params(plain, key), vocab=vocab)
  return drafter.with_weight_layout(cfg.weight_layout)


@struct.dataclass
class Pairs:
  """Drafter pairs accepted since the last round: pair i is (f_t, x_{t+1}), t = start + i."""

  tokens: jax.Array  # [B, R] x_{t+1}
  features: jax.Array  # [B, R, D] f_t
  count: jax.Array  # [B] valid pairs (the last one holds the bonus token)

  def last(self, x_BR):
    """The entry of the last valid pair, per sequence: [B, 1, ...]."""
    return take_rows(x_BR, jnp.maximum(self.count - 1, 0)[:, None])


def take_rows(x_BM, index_BP):
  """x[b, index[b, p]] along axis 1, any trailing dims."""
  index = index_BP.reshape(index_BP.shape + (1,) * (x_BM.ndim - 2))
  return jnp.take_along_axis(x_BM, index, axis=1)


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
  """`num_candidates` distinct draws from each row of q, without replacement (Gumbel-top-k).

  Returns:
    (index [..., k], score [..., k]): the draws (indices into the row) in the order drawn, and
    for rank r the log q of the most probable index not among draws 0..r-1 (never below the
    draw's own log q; it reads the draws before rank r only).
  """
  k = num_candidates
  index = jax.lax.top_k(logq_XV + jax.random.gumbel(key, logq_XV.shape), k)[1]
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
    u = drafter.apply(
      target.embed(node_tokens[:, nodes]), node_g[:, a.parent[nodes]], method=FeatureDrafter.pairs
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


def pld_candidates(tokens_BW, num_tokens_B, num_draft, max_ngram, min_ngram=1):
  """Prompt lookup: the K tokens after the most recent earlier occurrence of the suffix.

  The longest suffix n-gram (`max_ngram` down to `min_ngram`) with an earlier occurrence wins;
  among its occurrences the most recent. A continuation that reaches the end of the known
  tokens starts over from its own beginning: the q tokens between the occurrence and the end
  are taken as a loop of period q (`1 1 1` continues `1 1 ...`, `a b a b` continues `a b ...`).
  Returns tokens [B, K] and whether each is a real proposal (all of them when a match exists).
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
    return tokens_W[jnp.clip(index, 0, width - 1)], ok

  return jax.vmap(one)(tokens_BW, num_tokens_B)


def _propose_pld(drafter, target, cache, pairs, context, pool):
  tokens_BW, num_tokens_B = context
  tokens, ok = pld_candidates(tokens_BW, num_tokens_B, pool.depth, drafter.cfg.max_ngram)
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
