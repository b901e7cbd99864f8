"""Layers shared by the target and the drafters: rotary embeddings, attention over cache slots
and new tokens,
parameters with logical axis names, dense weights in either storage layout (`panels.LAYOUTS`),
stacked or per-layer parameters (`LlamaConfig.scan_layers`), and RMSNorm.

`cfg` is a `llama.LlamaConfig` everywhere (the drafters pass their layer's config).
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pspec_jax import cpu_kernel, panels

__all__ = [
  "DENSE_AXES",
  "RMSNorm",
  "apply_rope",
  "attend",
  "cache_scores",
  "cache_values",
  "dense",
  "dense_many",
  "dense_param",
  "param",
  "relayout",
  "rope_inv_freq",
  "set_scan_layers",
  "stack_layers",
]


def rope_inv_freq(cfg) -> np.ndarray:
  """Inverse frequencies [H/2] in float32, as HF computes them (incl. Llama-3 scaling), for a
  `llama.LlamaConfig`."""
  h = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h))
  inv_freq = inv_freq.astype(np.float32)
  s = cfg.rope_scaling
  if s is None:
    return inv_freq
  old_len = s.original_max_position_embeddings
  low_freq_wavelen = old_len / s.low_freq_factor
  high_freq_wavelen = old_len / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _cpu_decoding(cfg) -> bool:
  """Whether `cfg` is the CPU's decoding layout (float32 panels) and the CPU kernels run it."""
  return (
    cfg.weight_layout == "panels" and jnp.dtype(cfg.dtype) == jnp.float32 and cpu_kernel.available()
  )


def apply_rope(
  x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray, cfg=None
) -> jax.Array:
  """Rotates q or k by position, HF "rotate half" layout. Angles in float32 for accuracy.

  In the CPU's decoding layout (float32 panels, `cfg`) where the kernels are built, cos and sin
  come from `cpu_kernel.rope_cos_sin`, computed once per pass for every layer's q and k: XLA:CPU
  fused `jnp.cos` and `jnp.sin` into each rotation and computed them for every head of every
  layer again (0.11 ms of a plain step of the embedded default, 0.63 ms of a 9-node pass)."""
  freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)[..., None, :]
  xla = lambda a: (jnp.cos(a), jnp.sin(a))
  if cfg is not None and _cpu_decoding(cfg):
    cos, sin = cpu_kernel.platform_dependent(angles_BTH, cpu=cpu_kernel.rope_cos_sin, default=xla)
  else:
    cos, sin = xla(angles_BTH)
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTNH.dtype)


def cache_scores(q_BTKGH, k_BSKH):
  """q . k over cache slots: [B, T, K, G, S], reading the cache in its stored layout.

  A dot with (B, K) as batch dimensions makes XLA transpose every layer's cache slice to
  [B, K, S, H] first, a full copy per step that cost more than the weights at batch 8. Here
  each query is spread over all K*H columns with zeros outside its own head (K times the
  flops, nothing next to the weights at decode sizes), so the cache is read as a plain
  [B, S, K*H] matrix.
  """
  b, t, k, g, h = q_BTKGH.shape
  own = jnp.eye(k, dtype=q_BTKGH.dtype)
  q_BQC = jnp.einsum("BTKGH,KJ->BTKGJH", q_BTKGH, own).reshape(b, t * k * g, k * h)
  k_BSC = k_BSKH.reshape(b, k_BSKH.shape[1], k * h)
  scores = jnp.einsum("BQC,BSC->BQS", q_BQC, k_BSC, preferred_element_type=jnp.float32)
  return scores.reshape(b, t, k, g, -1)


def cache_values(probs_BTKGS, v_BSKH):
  """probs . v over cache slots: [B, T, K, G, H], the cache read as [B, S, K*H] (see above)."""
  b, t, k, g, s = probs_BTKGS.shape
  h = v_BSKH.shape[-1]
  out = jnp.einsum(
    "BQS,BSC->BQC", probs_BTKGS.reshape(b, t * k * g, s), v_BSKH.reshape(b, s, k * h)
  )
  own = jnp.eye(k, dtype=out.dtype)
  return jnp.einsum("BTKGJH,KJ->BTKGH", out.reshape(b, t, k, g, k, h), own)


def attend(cfg, q_BTKGH, k_BTKH, v_BTKH, mask_BTT, cache_kv, cache_len_B):
  """softmax(q . k / sqrt(H)) v for T new tokens: [B, T, K, G, H] in `cfg.dtype`.

  Keys are the cache's slots s < cache_len[b] (`cache_kv` = (k, v) [B, S, K, H], or None),
  then the new tokens where `mask_BTT` allows. Scores and softmax run in float32: bf16 logits
  lose too much at long contexts. Decoding in float32 with panel weights on a CPU (the CPU's
  decoding layout, never sharded), up to `cpu_kernel.MAX_ROWS` new tokens, it is one
  `cpu_kernel.attention` call where the kernels are built: it reads the cache once; XLA's dots
  below read it in pieces.
  """
  if (
    cache_kv is not None
    and q_BTKGH.shape[1] <= cpu_kernel.MAX_ROWS  # more new tokens: a prefill, XLA's GEMMs
    and _cpu_decoding(cfg)
  ):
    args = (q_BTKGH, k_BTKH, v_BTKH, mask_BTT, cache_kv, cache_len_B)
    b, t = q_BTKGH.shape[:2]
    kernel = lambda q, k, v, mask, kv, lengths: cpu_kernel.attention(
      q, *kv, lengths, k, v, jnp.broadcast_to(mask, (b, t, t)), 1.0 / math.sqrt(q.shape[-1])
    )
    out = cpu_kernel.platform_dependent(*args, cpu=kernel, default=functools.partial(_attend, cfg))
    return out.astype(cfg.dtype)
  return _attend(cfg, q_BTKGH, k_BTKH, v_BTKH, mask_BTT, cache_kv, cache_len_B)


def _attend(cfg, q_BTKGH, k_BTKH, v_BTKH, mask_BTT, cache_kv, cache_len_B):
  """`attend` with XLA's dots."""
  dt = cfg.dtype
  b, t = q_BTKGH.shape[:2]
  scale = 1.0 / math.sqrt(q_BTKGH.shape[-1])
  f32 = dict(preferred_element_type=jnp.float32)
  scores = jnp.einsum("BTKGH,BUKH->BTKGU", q_BTKGH, k_BTKH, **f32) * scale
  mask_BTU = mask_BTT
  if cache_kv is not None:
    # Keys are [cache slots..., new tokens...]; slot s is visible iff s < cache_len[b].
    k_BSKH, v_BSKH = cache_kv
    s = k_BSKH.shape[1]
    visible_BS = jnp.arange(s)[None, :] < cache_len_B[:, None]
    visible_BTS = jnp.broadcast_to(visible_BS[:, None, :], (b, t, s))
    scores = jnp.concatenate([cache_scores(q_BTKGH, k_BSKH.astype(dt)) * scale, scores], axis=-1)
    mask_BTU = jnp.concatenate([visible_BTS, mask_BTT], axis=-1)
  scores = jnp.where(mask_BTU[:, :, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  if cache_kv is None:
    return jnp.einsum("BTKGU,BUKH->BTKGH", probs, v_BTKH)
  out = cache_values(probs[..., :s], v_BSKH.astype(dt))
  return out + jnp.einsum("BTKGU,BUKH->BTKGH", probs[..., s:], v_BTKH)


def param(module, name, init, shape, axes, dtype):
  """A parameter of `module` with the logical axis names `axes` (`sharding.RULES`)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


# Every dense weight, by parameter name: the number of input and output axes of its plain
# layout (leading axes, such as stacked layers, come before them).
DENSE_AXES = {
  "q": (1, 2),
  "k": (1, 2),
  "v": (1, 2),
  "o": (2, 1),
  "gate": (1, 1),
  "up": (1, 1),
  "down": (1, 1),
  "lm_head": (1, 1),
  "fuse": (1, 1),
  "feature_fuse": (1, 1),
  "heads": (1, 2),
}


def dense_param(module, name, in_shape, out_shape, axes, cfg):
  """A dense weight declared in `cfg.weight_layout`: plain `in_shape + out_shape` with the
  logical `axes`, or panels of the flattened [prod(in), prod(out)] matrix (never sharded),
  float or, as loaded from a GGUF file, block-quantised."""
  init = nn.initializers.normal(0.02)
  if cfg.weight_layout == "panels":
    stored = module.get_variable("params", name)
    if getattr(stored, "dtype", None) == jnp.uint8:
      return stored  # block-quantised panels (`panels.pack_blocks`), whose shape is their own
    shape = panels.packed_shape(math.prod(in_shape), math.prod(out_shape))
    return param(module, name, init, shape, (None, None, None), cfg.param_dtype)
  return param(module, name, init, (*in_shape, *out_shape), axes, cfg.param_dtype)


def dense(cfg, x_XK, w, n: int, preferred_element_type=None):
  """x @ W in the compute dtype, for W in `cfg.weight_layout`: [..., K] -> [..., n].

  The one matrix product of every layer, whatever the layout: plain weights are reshaped
  (free for row-major arrays; a two-axis contraction made XLA:CPU copy the weight every step).
  """
  return dense_many(cfg, x_XK, [(w, n)], preferred_element_type)[0]


def dense_many(cfg, x_XK, weights, preferred_element_type=None) -> list:
  """`dense` of the same x by each (W, n) of `weights` (a layer's q, k and v; gate and up). In
  panels on the CPU kernel they are one call (`panels.matmuls`): a decoding step's threads
  meet once per group, not once per weight, and share the few panels of k and v."""
  if cfg.weight_layout == "panels":
    return panels.matmuls(x_XK, weights, cfg.dtype, preferred_element_type)
  x = x_XK.astype(cfg.dtype)
  return [
    jnp.matmul(
      x, w.astype(cfg.dtype).reshape(x.shape[-1], n), preferred_element_type=preferred_element_type
    )
    for w, n in weights
  ]


def relayout(params: dict, layout: str, plain_shapes: dict) -> dict:
  """Every dense weight (`DENSE_AXES`) of `params` moved to `layout`; other leaves as they are.

  `plain_shapes` is the tree of the parameters' plain shapes (e.g. `jax.eval_shape` of the
  plain model's init), which says how wide a padded panel weight really is.
  """
  if layout not in panels.LAYOUTS:
    raise ValueError(f"unknown weight layout {layout!r}: use one of {panels.LAYOUTS}")

  def move(path, w, plain):
    dims = _dense_dims(path, plain)
    if dims is None:
      return w
    lead, k, n = dims
    is_panels = w.shape != plain.shape
    if layout == "panels" and not is_panels:
      return panels.pack(w.reshape(*lead, k, n))
    if layout == "plain" and is_panels:
      return panels.unpack(panels.floats(w), n).reshape(plain.shape)
    return w

  return jax.tree_util.tree_map_with_path(move, params, plain_shapes)


def _dense_dims(path, plain) -> tuple[tuple, int, int] | None:
  """A dense weight's (leading axes, K, N) from its plain shape; None for any other leaf."""
  name = path[-1].key if hasattr(path[-1], "key") else None
  if name not in DENSE_AXES:
    return None
  n_in, n_out = DENSE_AXES[name]
  lead = plain.shape[: len(plain.shape) - n_in - n_out]
  k = math.prod(plain.shape[len(lead) : len(lead) + n_in])
  return lead, k, math.prod(plain.shape[len(lead) + n_in :])


def quantize_dense(params: dict, plain_shapes: dict) -> dict:
  """Every dense weight (`DENSE_AXES`) of `params`, float panels of one matrix whose K is a
  multiple of 32, as Q8_0 block-quantised panels (`panels.quantize_q8_0`); other leaves as
  they are."""

  def move(path, w, plain):
    dims = _dense_dims(path, plain)
    if dims is None or w.dtype == jnp.uint8 or w.shape == plain.shape:
      return w
    lead, k, n = dims
    if lead or k % panels.QUANT_K:  # stacked layers, or K off the blocks: left as they are
      return w
    return panels.quantize_q8_0(panels.unpack(w, n).reshape(k, n))

  return jax.tree_util.tree_map_with_path(move, params, plain_shapes)


def stack_layers(layers: list[dict]) -> jax.Array:
  """Per-layer parameter trees -> one tree with a leading layers axis (the nn.scan layout)."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def set_scan_layers(params: dict, num_layers: int, scan: bool) -> dict:
  """Converts parameters between the scanned (`layers`) and looped (`layers_{i}`) layouts."""
  params = dict(params)
  if scan and "layers" not in params:
    params["layers"] = stack_layers([params.pop(f"layers_{i}") for i in range(num_layers)])
  elif not scan and "layers" in params:
    stacked = params.pop("layers")
    for i in range(num_layers):
      params[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return params


class RMSNorm(nn.Module):
  """Root-mean-square norm, computed in float32 like HF's LlamaRMSNorm."""

  cfg: Any  # a llama.LlamaConfig

  @nn.compact
  def __call__(self, x):
    scale = param(
      self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",), self.cfg.param_dtype
    )
    x32 = x.astype(jnp.float32)
    mean = row_sum(x32 * x32) / x32.shape[-1]
    x32 = x32 * jax.lax.rsqrt(mean + self.cfg.rms_norm_eps)
    return (scale.astype(jnp.float32) * x32).astype(self.cfg.dtype)


def row_sum(x: jax.Array) -> jax.Array:
  """The sum over the last axis, keeping it (size 1), in an order fixed by the width alone.

  XLA:CPU reduces rows in an order that depends on how many rows it reduces (from 8 rows on it
  vectorises across them), so a row's sum, and everything after it, changed with the rows
  beside it: a verified tree node's norm was not a plain step's. Elementwise adds of halves
  (pairwise summation) fix the order on every backend.
  """
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    rest = x[..., 2 * half :]  # an odd width's last element, added to the first
    x = x[..., :half] + x[..., half : 2 * half]
    if rest.shape[-1]:
      x = jnp.concatenate([x[..., :1] + rest, x[..., 1:]], axis=-1)
  return x
