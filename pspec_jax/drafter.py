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

The drafting itself, each round, is in `propose`.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from pspec_jax import layers, panels, tree_specs
from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Block, LlamaConfig, RopeScaling, Target

__all__ = [
  "KINDS",
  "Drafter",
  "DrafterConfig",
  "FeatureDrafter",
  "MedusaHeads",
  "init_boxed",
  "init_params",
  "module",
  "random_drafter",
]

KINDS = ("pspec", "eagle", "medusa", "pld")
Dtype = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
  """A drafter's kind, draft length, decoder-layer widths and the target it was built for.

  Attributes:
    kind: one of KINDS.
    num_draft: K, the draft tokens per round it was built for (pspec: K-1 mask vectors;
      medusa: K heads). Decoding may use fewer.
    tree: the tree preset it is meant to decode with (`tree_specs.parse`), greedy.
    sampling_tree: the tree it decodes with at temperature > 0; "" is `tree`. Sampled drafts
      are accepted less often than greedy ones, so a smaller tree (or prompt lookup alone)
      can be the faster one there.
    adaptive: the candidate trees (`A|B|...`) the tree `adaptive` chooses from each round;
      "" is `tree_specs.ADAPTIVE`.
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
        tree_specs.parse(self.resolve_tree(tree), self.num_draft)

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
    self.fuse = layers.dense_param(self, "fuse", (2 * d,), (d,), ("fused", "embed"), cfg.layer)
    self.block = Block(cfg.layer)
    self.norm = layers.RMSNorm(cfg.layer)
    if cfg.kind == "pspec":
      slots = (max(cfg.num_draft - 1, 1), d)
      self.mask_slots = layers.param(
        self, "mask_slots", init, slots, ("draft", "embed"), cfg.param_dtype
      )

  def pairs(self, embeds_BTD, features_BTD):
    """u_t = Fuse([embed(x_{t+1}); f_t])."""
    dt = self.cfg.dtype
    x = jnp.concatenate([embeds_BTD.astype(dt), features_BTD.astype(dt)], axis=-1)
    return layers.dense(self.cfg.layer, x, self.fuse, self.cfg.hidden_size)

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
    w = layers.param(self, "w", init, (k, d, d), ("draft", "embed", "mlp"), cfg.param_dtype)
    b = layers.param(self, "b", nn.initializers.zeros, (k, d), ("draft", "mlp"), cfg.param_dtype)
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
      return layers.dense(self.cfg.layer, g_XD, head, self.cfg.draft_vocab_size, jnp.float32)
    f32 = dict(preferred_element_type=jnp.float32)
    return jnp.einsum("...D,VD->...V", g_XD.astype(head.dtype), head, **f32)

  def with_weight_layout(self, layout: str) -> "Drafter":
    """The same drafter with its dense weights stored in `layout` (`panels.LAYOUTS`)."""
    if layout == self.cfg.weight_layout:
      return self
    plain = self.cfg.replace(weight_layout="plain")
    shapes = jax.eval_shape(lambda: init_params(plain, jax.random.key(0)))
    params = layers.relayout(self.params, layout, shapes)
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
