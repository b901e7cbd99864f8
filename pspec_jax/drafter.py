"""Drafters: what proposes the token tree each round (docs/design.md sections 2 and 5).

Every kind reads the target through its features f_t and shares the target's embedding and LM
head (passed in at apply time, never part of the drafter's parameters):

- `pspec`: pair t is u_t = Fuse([embed(x_{t+1}); h_t]) at position t, h_t the target feature it
  reads (f_t, or with `feature_layers` the hidden states of those target layers projected to D
  and normed, EAGLE-3 style); `num_layers` decoder layers (the target's block, its own width
  settings) and a norm give g_t, whose logits W·g_t predict x_{t+2}. K-1 mask slots are
  appended after the last real pair a, at positions a + d, their inputs learned vectors m_d
  (`mask_input="per_depth"`) or one learned vector m (`"shared"`); slot (a, d) sees the real
  pairs up to a and the slots (a, d' <= d), and predicts x_{a+d+2}. One pass proposes
  x_{a+2} .. x_{a+K+1}.
- `eagle`: the same layer run auto-regressively (EAGLE-1): g_t also stands in for f_{t+1}, so a
  tree node's pair is (g of its parent, its token); the tree is drafted level by level.
- `medusa`: K residual heads on the last feature; head d predicts x_{t+d+1} from f_t.
- `pld`: prompt lookup, no parameters: the continuation of the longest most recent n-gram
  match of the sequence's suffix. Decoded with a drafted tree (`chain`) it is verified every
  round; the command-line default, the tree `lookup`, verifies it only in rounds with a match
  (the same lookup chain any drafter's tree can add, `tree.py`).

The drafting itself, each round, is in `propose`.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from pspec_jax import layers, panels
from pspec_jax.drafter_config import KINDS, MASK_INPUTS, DrafterConfig
from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Block, Target

__all__ = [
  "KINDS",
  "MASK_INPUTS",
  "Drafter",
  "DrafterConfig",
  "FeatureDrafter",
  "MedusaHeads",
  "init_boxed",
  "init_params",
  "module",
  "random_drafter",
  "read_target",
]


class FeatureDrafter(nn.Module):
  """`pspec` and `eagle`: Fuse([embed(x_{t+1}); h_t]) -> `num_layers` decoder layers -> norm.

  Parameters: `fuse`, `block` (then `block_1`, ... for deeper drafters), `norm`; with
  `feature_layers` `feature_fuse` and `feature_norm`; pspec's `mask_slots` [K-1, D] (per depth)
  or `mask_vector` [D] (shared). A default drafter has exactly the parameters of EAGLE-1's
  layout, so drafter files written before these options load unchanged.
  """

  cfg: DrafterConfig

  def setup(self):
    cfg, d = self.cfg, self.cfg.hidden_size
    init = nn.initializers.normal(0.02)
    self.fuse = layers.dense_param(self, "fuse", (2 * d,), (d,), ("fused", "embed"), cfg.layer)
    if cfg.feature_layers:
      e = cfg.feature_width
      self.feature_fuse = layers.dense_param(
        self, "feature_fuse", (e,), (d,), ("fused", "embed"), cfg.layer
      )
      self.feature_norm = layers.RMSNorm(cfg.layer)
    self.block = Block(cfg.layer)
    for i in range(1, cfg.num_layers):
      setattr(self, f"block_{i}", Block(cfg.layer))
    self.norm = layers.RMSNorm(cfg.layer)
    if cfg.kind == "pspec" and cfg.mask_input == "shared":
      self.mask_vector = layers.param(self, "mask_vector", init, (d,), ("embed",), cfg.param_dtype)
    elif cfg.kind == "pspec":
      slots = (max(cfg.num_draft - 1, 1), d)
      self.mask_slots = layers.param(
        self, "mask_slots", init, slots, ("draft", "embed"), cfg.param_dtype
      )

  @property
  def blocks(self) -> list[Block]:
    return [self.block] + [getattr(self, f"block_{i}") for i in range(1, self.cfg.num_layers)]

  def features(self, features_BTE):
    """h_t in the drafter's width: f_t as it is, or the feature layers' hidden states
    projected to D by one dense and normed (their scale grows with depth in the target)."""
    if not self.cfg.feature_layers:
      return features_BTE
    x = features_BTE.astype(self.cfg.dtype)
    return self.feature_norm(
      layers.dense(self.cfg.layer, x, self.feature_fuse, self.cfg.hidden_size)
    )

  def pairs(self, embeds_BTD, features_BTE):
    """u_t = Fuse([embed(x_{t+1}); h_t]) from the target's features (`read_target`)."""
    return self.fuse_pairs(embeds_BTD, self.features(features_BTE))

  def fuse_pairs(self, embeds_BTD, h_BTD):
    """Fuse([embed; h]) of an h already in the drafter's width (eagle's tree nodes pass g)."""
    dt = self.cfg.dtype
    x = jnp.concatenate([embeds_BTD.astype(dt), h_BTD.astype(dt)], axis=-1)
    return layers.dense(self.cfg.layer, x, self.fuse, self.cfg.hidden_size)

  def slots(self):
    """The mask-slot inputs m_1..m_{K-1} [K-1, D] (one shared vector repeated, if shared)."""
    if self.cfg.mask_input == "shared":
      m = self.mask_vector.astype(self.cfg.dtype)
      return jnp.broadcast_to(m, (max(self.cfg.num_draft - 1, 1), m.shape[-1]))
    return self.mask_slots.astype(self.cfg.dtype)

  def __call__(self, x_BTD, positions_BT, mask_BTT, cache: KVCache):
    """g_BTD (normed: the LM-head input) and the new keys/values [L, B, T, K, H]."""
    mask_BTT = jnp.broadcast_to(mask_BTT, (x_BTD.shape[0], *mask_BTT.shape[-2:]))
    new_k, new_v = [], []
    for i, block in enumerate(self.blocks):
      x_BTD, (k, v) = block(x_BTD, cache.layer(i), positions_BT, mask_BTT, cache.lengths)
      new_k.append(k)
      new_v.append(v)
    return self.norm(x_BTD), (jnp.stack(new_k), jnp.stack(new_v))

  def train_forward(self, embeds_BTD, features_BTE, positions_BT, mask_BTT, slots=None):
    """The training layout: real pairs, then (pspec) the mask-slot groups.

    Args:
      embeds_BTD, features_BTE: pair t is (embed(x[t+1]), h[t]).
      positions_BT, mask_BTT: the pairs' RoPE positions and attention (causal within each
        packed conversation).
      slots: a `losses.SlotLayout` (pspec), or None for the real pairs alone.

    Returns:
      (g_BTD, slot groups): normed drafter features of the pairs, and of the slots one
      [B, A_i, P_i, D] array per tier (i, P_i) of `slots.tiers` (None without slots).
    """
    x = self.pairs(embeds_BTD, features_BTE)
    kvs = []
    for block in self.blocks:
      x, kv = block(x, None, positions_BT, mask_BTT, None)
      kvs.append(kv)
    if slots is None:
      return self.norm(x), None
    keys = jnp.arange(x.shape[1])
    groups = []
    for lo, hi, p in slots.tiers:
      first, visible = slots.first[:, lo:hi], slots.visible[:, lo:hi]
      sees_BAT = (keys >= first[..., None]) & (keys < visible[..., None])
      positions_BAP = slots.positions[:, lo:hi, :p]
      y = jnp.broadcast_to(self.slots()[:p], (*positions_BAP.shape, x.shape[-1]))
      # Layer l of a slot reads layer l's keys/values of the real pairs, as in decoding.
      for block, kv in zip(self.blocks, kvs, strict=True):
        y = block.grouped(y, positions_BAP, kv, sees_BAT)
      groups.append(self.norm(y))
    return self.norm(x), tuple(groups)

  def init_all(self, embeds_BTD, features_BTE):
    """Touches every parameter (for `init`)."""
    u = self.pairs(embeds_BTD, features_BTE)
    if self.cfg.kind == "pspec":
      u = u + self.slots()[0]
    positions = jnp.zeros(u.shape[:2], jnp.int32)
    mask = jnp.ones((1, u.shape[1], u.shape[1]), jnp.bool_)
    for block in self.blocks:
      u = block(u, None, positions, mask, None)[0]
    return self.norm(u)


class MedusaHeads(nn.Module):
  """`medusa`: head d maps f_t to f_t + SiLU(W_d f_t + b_d), read by the target's LM head.

  The K heads are one dense weight `heads` [D, K, D] (`layers.dense_param`), so they decode in
  the layout and through the product every other dense layer uses. (As K weights [K, D, D]
  under an einsum, XLA:CPU copied all of them, 5 MiB for SmolLM2-135M, in every round.)
  """

  cfg: DrafterConfig

  @nn.compact
  def __call__(self, features_BD):
    cfg, d, k = self.cfg, self.cfg.hidden_size, self.cfg.num_draft
    w = layers.dense_param(self, "heads", (d,), (k, d), ("embed", "draft", "mlp"), cfg.layer)
    b = layers.param(self, "b", nn.initializers.zeros, (k, d), ("draft", "mlp"), cfg.param_dtype)
    f = features_BD.astype(cfg.dtype)
    h = layers.dense(cfg.layer, f, w, k * d).reshape(*f.shape[:-1], k, d) + b.astype(cfg.dtype)
    return f[:, None, :] + nn.silu(h)


def module(cfg: DrafterConfig) -> nn.Module:
  return MedusaHeads(cfg) if cfg.kind == "medusa" else FeatureDrafter(cfg)


def init_boxed(cfg: DrafterConfig, key: jax.Array) -> dict:
  """Random parameters, each boxed with its logical axis names; `pld` has none."""
  if cfg.kind == "pld":
    return {}
  embeds = jnp.zeros((1, 1, cfg.hidden_size), cfg.dtype)
  if cfg.kind == "medusa":
    return MedusaHeads(cfg).init(key, embeds[:, 0])["params"]
  features = jnp.zeros((1, 1, cfg.feature_width), cfg.dtype)
  return FeatureDrafter(cfg).init(key, embeds, features, method=FeatureDrafter.init_all)["params"]


def init_params(cfg: DrafterConfig, key: jax.Array) -> dict:
  """Random parameters (an untrained drafter); `pld` has none."""
  return nn.meta.unbox(init_boxed(cfg, key))


@struct.dataclass
class Drafter:
  """A drafter: its (static) config and its parameters, passable through `jax.jit`.

  `vocab` holds the token ids of a restricted draft vocabulary ([V'] int32, None for the whole
  vocabulary); `head` is the target's LM head restricted to them ([V', D], or in the panel
  layout the packed [D, V']), derived by `with_head` (never stored in drafter files: the LM
  head is the target's). A drafter loaded for a target has it already
  (`drafter_files.load_drafter`); without it, `decode.generate` gathers it in every call,
  which cost the embedded default's decodes 20 ms each (a 128-token decode takes about 500 ms
  on a 2-core CPU). Replace `vocab` only together with `head=None`.
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
    """The restricted head: [V', D] rows, or in panels the [D, V'] matrix (`weight_layout`):
    of a block-quantised head, its own blocks (the same weights, a fifth of the bytes)."""
    head = target.params.get("lm_head")
    if self.cfg.weight_layout == "panels" and head is not None and head.dtype == jnp.uint8:
      return panels.take_columns(head, self.vocab)
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

  def with_draft_vocab(self, size: int) -> "Drafter":
    """The same drafter proposing from the first `size` tokens of its draft vocabulary, which
    `data.frequent_tokens` orders most frequent first: a smaller LM head to read in every
    drafter pass, for drafts that miss the rare tokens left out. Decoding stays lossless."""
    if self.vocab is None:
      raise ValueError("this drafter has no draft vocabulary to cut: it drafts from the whole")
    if not 0 < size <= len(self.vocab):
      raise ValueError(f"draft vocabulary size must be in [1, {len(self.vocab)}], got {size}")
    if size == len(self.vocab):
      return self
    cfg = self.cfg.replace(draft_vocab_size=size)
    return self.replace(cfg=cfg, vocab=self.vocab[:size], head=None)

  def with_weight_layout(self, layout: str) -> "Drafter":
    """The same drafter with its dense weights stored in `layout` (`panels.LAYOUTS`)."""
    if layout == self.cfg.weight_layout:
      return self
    params = layers.relayout(self.params, layout, self._plain_shapes())
    # The head is stored in the layout too: gathered again (`with_head`) in the new one.
    return self.replace(cfg=self.cfg.replace(weight_layout=layout), params=params, head=None)

  def _plain_shapes(self) -> dict:
    """The parameters' shapes in the plain layout (what a panel weight really holds)."""
    plain = self.cfg.replace(weight_layout="plain")
    return jax.eval_shape(lambda: init_params(plain, jax.random.key(0)))

  def with_blocks(self) -> "Drafter":
    """The same drafter with its dense weights in Q8_0 block-quantised panels (a drafter in
    panels; `layers.quantize_dense`): for a target decoding from GGUF blocks on the CPU kernel,
    a quarter of the float32 bytes, multiplied with the target's 8-bit arithmetic. Drafts only
    propose, so this changes what it proposes a little, never what decoding outputs."""
    if self.cfg.weight_layout != "panels":
      return self
    return self.replace(params=layers.quantize_dense(self.params, self._plain_shapes()))

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
      num_layers=self.cfg.num_layers,
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


def read_target(
  target: Target, cfg: DrafterConfig | None, tokens_BT, positions_BT, cache=None, mask_BTT=None
):
  """One target pass for a drafter: (f_BTD, h_BTE, kv).

  f is the target's final feature (its LM-head input), h the feature the drafter reads: f
  itself, or with `cfg.feature_layers` those layers' hidden states concatenated
  (E = len(feature_layers) * D), from the same pass. `cfg` None (no drafter) reads f.
  """
  taps = () if cfg is None else cfg.feature_layers
  if not taps:
    features_BTD, kv = target(tokens_BT, positions_BT, cache, mask_BTT)
    return features_BTD, features_BTD, kv
  features_BTD, kv, hidden_BTE = target(tokens_BT, positions_BT, cache, mask_BTT, taps)
  return features_BTD, hidden_BTE, kv
