"""The Llama-family target model in Flax Linen (HF `LlamaForCausalLM` semantics).

RMSNorm, rotary position embeddings in HF's "rotate half" layout (with Llama-3 frequency
scaling), grouped-query attention, SwiGLU MLP and a tied or untied LM head; the decoder layers
run under `nn.scan`, so parameters are stacked on a leading `layers` axis.

One forward serves every use, because it never writes the cache itself:

- prefill of a right-padded ragged batch: `cache=None`, causal attention among the new tokens;
- cached decode of T new tokens: the new tokens attend to the first `cache.lengths[b]` cache
  slots of their sequence plus each other (causal);
- tree verification: T tree nodes with explicit per-node positions and a [T, T] node mask.

It returns the final features f_t (after the final norm, i.e. the LM-head input) and the new
tokens' keys and values; the caller decides which of them to write into the cache (all of them
after prefill or plain decode, only the accepted path after verification). Asked for `taps`,
the same pass also returns the hidden states (the residual stream) after those decoder layers,
which a drafter with `feature_layers` reads (docs/design.md section 2). Logits come from
`Llama.logits(features)` so callers compute them only where they are needed.
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from pspec_jax import layers, panels
from pspec_jax.kv_cache import KVCache

__all__ = [
  "Attention",
  "Block",
  "Llama",
  "LlamaConfig",
  "Mlp",
  "RopeScaling",
  "Target",
  "init_boxed",
  "init_params",
]

Dtype = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 style RoPE frequency scaling (HF `rope_type="llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f"bad rope scaling {self}: need factor > 0 and high_freq > low_freq factor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Architecture of a Llama-family target. Hashable, so it can be a static jit argument."""

  name: str = "llama"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0: hidden_size // num_heads
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_position_embeddings: int = 4096
  # True: layers under nn.scan, parameters stacked on a leading axis (fast compilation of deep
  # models; training). False: a loop over per-layer parameters `layers_{i}`, with one KV cache
  # buffer per layer. Decoding on CPU wants False: XLA copies each scanned layer's weight
  # slice, which tripled the cost of a batch-1 decode step of SmolLM2 (a memory-bound matvec)
  # in our measurements; copies of a stacked cache's layers cost a third of a batch-32 step.
  scan_layers: bool = True
  # How dense weights are stored (`panels.LAYOUTS`): "plain" [in..., out...], or "panels",
  # 64-column panels that XLA:CPU reads sequentially when it multiplies a few rows (decoding
  # and verifying small trees; see `pspec_jax.panels`). A storage choice made at load time
  # (`Target.with_weight_layout`), never stored in a checkpoint.
  weight_layout: str = "plain"
  dtype: Dtype = jnp.float32  # compute
  param_dtype: Dtype = jnp.float32  # storage

  def __post_init__(self):
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
      if getattr(self, field) <= 0:
        raise ValueError(f"LlamaConfig.{field} must be positive, got {getattr(self, field)}")
    if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    if self.head_dim == 0:
      if self.hidden_size % self.num_heads:
        raise ValueError("LlamaConfig.head_dim is needed: num_heads does not divide hidden_size")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if self.weight_layout not in panels.LAYOUTS:
      raise ValueError(
        f"LlamaConfig.weight_layout must be one of {panels.LAYOUTS}, got {self.weight_layout!r}"
      )

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)


class Attention(nn.Module):
  """Grouped-query attention over cache slots plus the new tokens."""

  cfg: LlamaConfig

  def setup(self):
    cfg = self.cfg
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.wq = layers.dense_param(self, "q", (d,), (n, h), ("embed", "q_heads", "head_dim"), cfg)
    self.wk = layers.dense_param(self, "k", (d,), (k, h), ("embed", "kv_heads", "head_dim"), cfg)
    self.wv = layers.dense_param(self, "v", (d,), (k, h), ("embed", "kv_heads", "head_dim"), cfg)
    self.wo = layers.dense_param(self, "o", (n, h), (d,), ("q_heads", "head_dim", "embed"), cfg)

  def _qkv(self, x_XD, positions_X):
    """q [..., N, H] and k, v [..., K, H] of any leading shape, RoPE applied to q and k."""
    cfg = self.cfg
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lead = x_XD.shape[:-1]
    # Projections as 2-D matmuls over flattened heads (`dense_many`: one kernel call for all 3).
    q, k_, v = layers.dense_many(cfg, x_XD, [(self.wq, n * h), (self.wk, k * h), (self.wv, k * h)])
    q, k_, v = q.reshape(*lead, n, h), k_.reshape(*lead, k, h), v.reshape(*lead, k, h)
    inv_freq = layers.rope_inv_freq(cfg)
    return (
      layers.apply_rope(q, positions_X, inv_freq, cfg),
      layers.apply_rope(k_, positions_X, inv_freq, cfg),
      v,
    )

  def _out(self, out_XNH):
    cfg = self.cfg
    n, h = cfg.num_heads, cfg.head_dim
    flat = out_XNH.reshape(*out_XNH.shape[:-2], n * h)
    return layers.dense(cfg, flat, self.wo, cfg.hidden_size)

  def __call__(self, x_BTD, positions_BT, mask_BTT, cache_kv, cache_len_B):
    cfg = self.cfg
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t = x_BTD.shape[:2]
    q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, positions_BT)
    q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
    out = layers.attend(cfg, q_BTKGH, k_BTKH, v_BTKH, mask_BTT, cache_kv, cache_len_B)
    return self._out(out.reshape(b, t, n, h)), (k_BTKH, v_BTKH)

  def grouped(self, x_BAPD, positions_BAP, prefix_kv, prefix_mask_BAS):
    """A groups of P queries each: group a sees the prefix keys where prefix_mask[b, a] and,
    causally, its own P queries. The training layout of mask slots: cost A*P*(S + P), not
    (A*P)^2."""
    cfg = self.cfg
    n, k, h, dt = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dtype
    b, a, p = x_BAPD.shape[:3]
    q_BAPNH, k_BAPKH, v_BAPKH = self._qkv(x_BAPD, positions_BAP)
    q_BAPKGH = q_BAPNH.reshape(b, a, p, k, n // k, h)
    k_BSKH, v_BSKH = prefix_kv
    scale = 1.0 / math.sqrt(h)
    f32 = dict(preferred_element_type=jnp.float32)
    prefix = jnp.einsum("BAPKGH,BSKH->BKGAPS", q_BAPKGH, k_BSKH.astype(dt), **f32) * scale
    own = jnp.einsum("BAPKGH,BAQKH->BKGAPQ", q_BAPKGH, k_BAPKH, **f32) * scale
    low = jnp.finfo(jnp.float32).min
    prefix = jnp.where(prefix_mask_BAS[:, None, None, :, None, :], prefix, low)
    own = jnp.where(jnp.tril(jnp.ones((p, p), jnp.bool_)), own, low)
    probs = jax.nn.softmax(jnp.concatenate([prefix, own], axis=-1), axis=-1).astype(dt)
    s = k_BSKH.shape[1]
    out = jnp.einsum("BKGAPS,BSKH->BAPKGH", probs[..., :s], v_BSKH.astype(dt))
    out = out + jnp.einsum("BKGAPQ,BAQKH->BAPKGH", probs[..., s:], v_BAPKH)
    return self._out(out.reshape(b, a, p, n, h))


class Mlp(nn.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BTD):
    cfg = self.cfg
    d, f = cfg.hidden_size, cfg.intermediate_size
    gate = layers.dense_param(self, "gate", (d,), (f,), ("embed", "mlp"), cfg)
    up = layers.dense_param(self, "up", (d,), (f,), ("embed", "mlp"), cfg)
    down = layers.dense_param(self, "down", (f,), (d,), ("mlp", "embed"), cfg)
    gate_BTF, up_BTF = layers.dense_many(cfg, x_BTD, [(gate, f), (up, f)])
    h_BTF = nn.silu(gate_BTF) * up_BTF
    return layers.dense(cfg, h_BTF, down, d)


class Block(nn.Module):
  """One pre-norm decoder layer. Scanned: carry is the residual stream, x is the cache layer."""

  cfg: LlamaConfig

  def setup(self):
    self.attn_norm = layers.RMSNorm(self.cfg)
    self.attn = Attention(self.cfg)
    self.mlp_norm = layers.RMSNorm(self.cfg)
    self.mlp = Mlp(self.cfg)

  def __call__(self, x_BTD, cache_kv, positions_BT, mask_BTT, cache_len_B):
    h, kv = self.attn(self.attn_norm(x_BTD), positions_BT, mask_BTT, cache_kv, cache_len_B)
    x_BTD = x_BTD + h
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "length", "embed"))
    return x_BTD, kv

  def grouped(self, x_BAPD, positions_BAP, prefix_kv, prefix_mask_BAS):
    """The layer over groups of queries (`Attention.grouped`)."""
    x_BAPD = x_BAPD + self.attn.grouped(
      self.attn_norm(x_BAPD), positions_BAP, prefix_kv, prefix_mask_BAS
    )
    return x_BAPD + self.mlp(self.mlp_norm(x_BAPD))


class _TappedBlock(Block):
  """A scanned layer that also keeps its output if it is one of `taps`: the carry holds the
  tapped hidden states [n, B, T, D] next to the residual stream (never all L layers' outputs)."""

  taps: tuple[int, ...] = ()

  def __call__(self, carry, cache_kv_and_index, positions_BT, mask_BTT, cache_len_B):
    x_BTD, taps_nBTD = carry
    cache_kv, index = cache_kv_and_index
    x_BTD, kv = super().__call__(x_BTD, cache_kv, positions_BT, mask_BTT, cache_len_B)
    here = (jnp.asarray(self.taps) == index)[:, None, None, None]
    return (x_BTD, jnp.where(here, x_BTD[None].astype(taps_nBTD.dtype), taps_nBTD)), kv


class Llama(nn.Module):
  """The target: `__call__` gives features and new keys/values, `logits` the LM head.

  `taps`: decoder layers (0-based) whose output hidden states `__call__` also returns.
  """

  cfg: LlamaConfig
  taps: tuple[int, ...] = ()

  def setup(self):
    cfg = self.cfg
    self.embedding = layers.param(
      self,
      "embedding",
      nn.initializers.normal(0.02),
      (cfg.vocab_size, cfg.hidden_size),
      ("vocab", "embed"),
      cfg.param_dtype,
    )
    if not cfg.tie_embeddings:
      self.lm_head = layers.dense_param(
        self, "lm_head", (cfg.hidden_size,), (cfg.vocab_size,), ("embed", "vocab"), cfg
      )
    bad = [i for i in self.taps if not 0 <= i < cfg.num_layers]
    if bad or len(set(self.taps)) < len(self.taps):
      raise ValueError(
        f"feature layers {self.taps} must be distinct layers of {cfg.name!r}, 0 to "
        f"{cfg.num_layers - 1}"
      )
    if cfg.scan_layers:
      tapped = dict(taps=self.taps) if self.taps else {}
      self.layers = nn.scan(
        _TappedBlock if self.taps else Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )(cfg, **tapped)
    else:
      self.layers = [Block(cfg) for _ in range(cfg.num_layers)]  # params `layers_{i}`
    self.norm = layers.RMSNorm(cfg)

  def __call__(
    self,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    cache: KVCache | None = None,
    mask_BTT: jax.Array | None = None,
  ):
    """Runs the decoder over T new tokens.

    Args:
      tokens_BT: int token ids.
      positions_BT: RoPE position of every new token.
      cache: if given, new token t of sequence b also attends to cache slots
        [0, cache.lengths[b]) of its sequence. The cache itself is not written.
      mask_BTT: which new tokens each new token attends to ([B, T, T] or [T, T], bool);
        causal when omitted.

    Returns:
      (features_BTD, (k_LBTKH, v_LBTKH)): final-norm features f_t and the new tokens' keys and
      values, one entry per layer, ready for `KVCache.write`. With `taps`, a third entry:
      hidden_BTE, the hidden states after the tapped layers concatenated in `taps` order
      (E = len(taps) * D), from the same pass.
    """
    b, t = tokens_BT.shape
    if mask_BTT is None:
      mask_BTT = jnp.tril(jnp.ones((t, t), jnp.bool_))
    mask_BTT = jnp.broadcast_to(mask_BTT, (b, t, t))
    x_BTD = jnp.take(self.embedding, tokens_BT, axis=0).astype(self.cfg.dtype)
    x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "length", "embed"))
    cache_len_B = None if cache is None else cache.lengths
    taps = []
    if self.cfg.scan_layers:
      cache_kv = None if cache is None else cache.stacked()
      if self.taps:
        index = jnp.arange(self.cfg.num_layers)
        carry = (x_BTD, jnp.zeros((len(self.taps), *x_BTD.shape), x_BTD.dtype))
        (x_BTD, taps_nBTD), kv = self.layers(
          carry, (cache_kv, index), positions_BT, mask_BTT, cache_len_B
        )
        taps = list(taps_nBTD)
      else:
        x_BTD, kv = self.layers(x_BTD, cache_kv, positions_BT, mask_BTT, cache_len_B)
    else:
      new_k, new_v = [], []
      for i, block in enumerate(self.layers):
        layer_kv = None if cache is None else cache.layer(i)
        x_BTD, (k, v) = block(x_BTD, layer_kv, positions_BT, mask_BTT, cache_len_B)
        new_k.append(k)
        new_v.append(v)
        taps += [x_BTD] if i in self.taps else []
      taps = [taps[sorted(self.taps).index(i)] for i in self.taps]
      kv = (jnp.stack(new_k), jnp.stack(new_v))
    if not self.taps:
      return self.norm(x_BTD), kv
    return self.norm(x_BTD), kv, jnp.concatenate(taps, axis=-1)

  def logits(self, features_BTD: jax.Array) -> jax.Array:
    """LM head: float32 logits [B, T, V] from features f_t."""
    f = features_BTD.astype(self.cfg.dtype)
    f32 = dict(preferred_element_type=jnp.float32)
    if self.cfg.tie_embeddings:
      return jnp.einsum("...D,VD->...V", f, self.embedding.astype(self.cfg.dtype), **f32)
    return layers.dense(self.cfg, f, self.lm_head, self.cfg.vocab_size, jnp.float32)


def init_boxed(cfg: LlamaConfig, key: jax.Array) -> dict:
  """Random parameters, each boxed with its logical axis names."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Llama(cfg).init(key, tokens, tokens)["params"]


def init_params(cfg: LlamaConfig, key: jax.Array) -> dict:
  """Random parameters (plain arrays, logical-axis boxes removed)."""
  return nn.meta.unbox(init_boxed(cfg, key))


@struct.dataclass
class Target:
  """A target model: its (static) config and its parameters, passable through `jax.jit`."""

  cfg: LlamaConfig = struct.field(pytree_node=False)
  params: Any

  def __call__(self, tokens_BT, positions_BT, cache=None, mask_BTT=None, taps=()):
    """Features and new keys/values (and with `taps` the tapped hidden states); see
    `Llama.__call__`."""
    module = Llama(self.cfg, taps=tuple(taps))
    return module.apply({"params": self.params}, tokens_BT, positions_BT, cache, mask_BTT)

  def with_scan_layers(self, scan: bool) -> "Target":
    """The same model with its layers scanned (stacked params) or looped (per-layer params)."""
    if scan == self.cfg.scan_layers:
      return self
    params = layers.set_scan_layers(self.params, self.cfg.num_layers, scan)
    return Target(cfg=self.cfg.replace(scan_layers=scan), params=params)

  def with_weight_layout(self, layout: str) -> "Target":
    """The same model with its dense weights stored in `layout` (`panels.LAYOUTS`)."""
    if layout == self.cfg.weight_layout:
      return self
    cfg = self.cfg.replace(weight_layout=layout)
    plain = self.cfg.replace(weight_layout="plain")
    shapes = nn.meta.unbox(jax.eval_shape(lambda: init_boxed(plain, jax.random.key(0))))
    return Target(cfg=cfg, params=layers.relayout(self.params, layout, shapes))

  @property
  def keeps_blocks(self) -> bool:
    """Whether some dense weight is block-quantised panels (`checkpoints.keeps_gguf_blocks`)."""
    return any(x.dtype == jnp.uint8 for x in jax.tree.leaves(self.params))

  def logits(self, features_BTD: jax.Array) -> jax.Array:
    return Llama(self.cfg).apply({"params": self.params}, features_BTD, method=Llama.logits)

  def head_rows(self, token_ids: jax.Array) -> jax.Array:
    """The LM head's rows for some tokens, [V', D] in the compute dtype (a restricted head)."""
    p = self.params
    if self.cfg.tie_embeddings:
      rows = p["embedding"][token_ids]
    elif p["lm_head"].dtype == jnp.uint8:  # block-quantised: the panels of the rows, widened
      w_VKC = panels.dequantize(p["lm_head"][token_ids // panels.WIDTH])
      rows = jnp.take_along_axis(w_VKC, (token_ids % panels.WIDTH)[:, None, None], axis=2)[..., 0]
    elif self.cfg.weight_layout == "panels":  # column j of W is column j % 64 of panel j // 64
      rows = p["lm_head"][token_ids // panels.WIDTH, :, token_ids % panels.WIDTH]
    else:
      rows = p["lm_head"][:, token_ids].T
    return rows.astype(self.cfg.dtype)

  def embed(self, tokens_BT: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] (shared with drafters)."""
    return jnp.take(self.params["embedding"], tokens_BT, axis=0).astype(self.cfg.dtype)

  def empty_cache(self, batch: int, max_len: int) -> KVCache:
    """A cache in the layout this target reads best: one buffer per layer unless scanned."""
    cfg = self.cfg
    return KVCache.zeros(
      num_layers=cfg.num_layers,
      batch=batch,
      max_len=max_len,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      dtype=cfg.dtype,
      per_layer=not cfg.scan_layers,
    )
