"""Weights stored in 64-column panels: small-M matrix products at one row's cost on XLA:CPU.

A decoding step multiplies a few rows (1 token, or the M nodes of a verified tree) by every
weight of the model, so it is bound by reading the weights. For one row XLA:CPU emits its own
matrix-vector kernel, which streams W[K, N] row by row. From two rows on, the product goes to
YNNPACK, whose small-M kernel does not pack W: it reads 64 columns (256 bytes) of one row of
W, then jumps a whole row ahead, walking a narrow strip down all K rows. Every step lands on a
new page and the prefetchers lose it, so 2-4 rows cost about 1.3-1.6 single-row steps.

Stored as panels, `Wp[N/64, K, 64]` (each 64-column strip of W contiguous), the same product
is a dot batched over the panel axis, with x broadcast to every panel: YNNPACK's kernel then
reads each panel as one sequential stream. The width has to match the kernel's 64-column
block: 32 measured close, 16, 128 and 192 worse. Without the batch axis XLA copies W on every
call. A weight whose N is not a multiple of 64 is padded with zero columns, and the product
drops them again.

From about 6 rows on YNNPACK loses the stream again, and one row is no faster than the plain
layout's matrix-vector product: where it is built, the CPU panel kernel (`cpu_kernel`) takes
every product of up to 64 rows instead, streaming each panel once whatever the number of rows.

The layout is a storage choice made when a model is loaded for decoding (`LAYOUTS`); training,
sharded models and accelerators keep `plain`. `pack` and `unpack` convert between the two, on
any leading (e.g. stacked-layer) axes.

Block-quantised panels. A weight that a GGUF file stores in Q4_1 or Q8_0 blocks can stay in
them: `pack_blocks` regroups the file's blocks into panels, `[P, K/32, B]` uint8 (`BLOCK_BYTES`:
each 64 columns by 32 k carry their float scales and 4- or 8-bit values), a fifth of the float32
panels' bytes. The CPU kernel multiplies them as llama.cpp does: x quantised to 8 bits per 32 k
(dx = max |x| / 127), exact integer dot products per block, then y += (d dx) isum (+ m dx sum
qx), every row count alike (a prefill in calls of `cpu_kernel.MAX_ROWS` rows), so a row's result
is its own. The model is llama.cpp's model of the file: within about a percent of the float32
products of the dequantised weights. `dequantize` gives those weights (GGUF's own
dequantisation, bit for bit) for every path that reads rows of them (`relayout`, a head's rows)
and for XLA's product where the kernel does not run (the loader keeps blocks only where it
does).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pspec_jax import cpu_kernel

__all__ = [
  "BLOCK_BYTES",
  "LAYOUTS",
  "WIDTH",
  "dequantize",
  "matmul",
  "matmuls",
  "pack",
  "pack_blocks",
  "packed_shape",
  "quantize_q8_0",
  "take_columns",
  "unpack",
]

LAYOUTS = ("plain", "panels")
WIDTH = 64
QUANT_K = 32  # k per quantisation block
# Bytes of one block-quantised panel block (64 columns by 32 k), by GGUF type: float32 scales d
# (Q4_1: and minimums m), 64, then the values in the order integer dot products read them
# (`_value_order`). Q4_1 packs two columns in a byte.
BLOCK_BYTES = {"Q4_1": 2 * 4 * WIDTH + QUANT_K * WIDTH // 2, "Q8_0": 4 * WIDTH + QUANT_K * WIDTH}
_GGUF_BLOCK_BYTES = {"Q4_1": 4 + QUANT_K // 2, "Q8_0": 2 + QUANT_K}  # a GGUF block of 32 weights


def packed_shape(k: int, n: int) -> tuple[int, int, int]:
  """The panel layout's shape of a [K, N] weight: [ceil(N / 64), K, 64]."""
  return (math.ceil(n / WIDTH), k, WIDTH)


def pack(w_KN: jax.Array) -> jax.Array:
  """[..., K, N] -> [..., ceil(N / 64), K, 64], zero columns padding the last panel."""
  *lead, k, n = w_KN.shape
  p = math.ceil(n / WIDTH)
  w = jnp.pad(w_KN, [(0, 0)] * len(lead) + [(0, 0), (0, p * WIDTH - n)])
  return jnp.swapaxes(w.reshape(*lead, k, p, WIDTH), -3, -2)


def unpack(w_PKC: jax.Array, n: int) -> jax.Array:
  """The inverse of `pack`: [..., P, K, 64] -> [..., K, n]."""
  *lead, p, k, c = w_PKC.shape
  return jnp.swapaxes(w_PKC, -3, -2).reshape(*lead, k, p * c)[..., :n]


def pack_blocks(blocks: np.ndarray, kind: str, k: int, n: int) -> np.ndarray:
  """A GGUF tensor's blocks (`kind` in `BLOCK_BYTES`) of a [K, N] weight, i.e. N rows of K/32
  blocks of 32 weights along K, as block-quantised panels: [ceil(N / 64), K / 32, B] uint8,
  zero columns padding the last panel."""
  if kind not in BLOCK_BYTES:
    raise ValueError(
      f"no block-quantised panels for GGUF type {kind}: use one of {list(BLOCK_BYTES)}"
    )
  if k % QUANT_K:
    raise ValueError(f"a {kind} weight's K must be a multiple of {QUANT_K}, got {k}")
  nb, p = k // QUANT_K, math.ceil(n / WIDTH)
  b = np.asarray(blocks, np.uint8).reshape(n, nb, _GGUF_BLOCK_BYTES[kind])
  b = np.pad(b, ((0, p * WIDTH - n), (0, 0), (0, 0)))  # padding: d = m = q = 0, weight 0

  def panelled(x):  # [P * 64, nb, ...] -> [P, nb, ..., 64]
    x = x.reshape(p, WIDTH, nb, *x.shape[2:])
    return np.moveaxis(x, 1, -1)

  def f32_bytes(h):  # float16 [P*64, nb, 2] bytes -> float32 scales [P, nb, 64], as bytes
    f = np.ascontiguousarray(h).view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(panelled(f)).view(np.uint8)

  if kind == "Q4_1":
    qs = b[..., 4:]  # element j in the low nibble of byte j, element j + 16 in the high one
    q = panelled(np.concatenate([qs & 15, qs >> 4], axis=-1))  # [P, nb, 32 k, 64 c]
    scales = [f32_bytes(b[..., 0:2]), f32_bytes(b[..., 2:4])]
  else:
    q, scales = panelled(b[..., 2:]), [f32_bytes(b[..., 0:2])]
  parts = [*scales, _value_order(np, q, kind)]
  return np.concatenate([x.reshape(p, nb, -1) for x in parts], axis=-1)


def _value_order(xp, q, kind: str):
  """A block's values [..., 32 k, 64 c] (Q4_1: 0..15; Q8_0: int8 bits) in the order the
  kernel's integer dot products read them: for each 4 k (a quad j), 16 columns by 4 k a
  64-byte vector, each 32-bit lane one column's 4 products. Q4_1: per quad 2 vectors, the
  low nibbles columns 32h..32h+15, the high ones 32h+16..32h+31 (h = 0, 1); Q8_0: per quad 4
  vectors of columns 16g..16g+15, each value + 128 (unsigned). `xp`: numpy or jax.numpy."""
  lead = q.shape[:-2]
  n = len(lead)
  if kind == "Q4_1":
    q = q.reshape(*lead, 8, 4, 2, 2, 16)  # k = 4j + r, c = 32h + 16 hi + i: [j, r, h, hi, i]
    v = q[..., 0, :] | (q[..., 1, :] << 4)  # [j, r, h, i]
    v = xp.transpose(v, (*range(n), n, n + 2, n + 3, n + 1))  # [j, h, i, r]
  else:
    q = q.reshape(*lead, 8, 4, 4, 16)  # [j, r, g, i]
    v = xp.transpose(q, (*range(n), n, n + 2, n + 3, n + 1)) ^ 0x80  # [j, g, i, r]
  return v.reshape(*lead, QUANT_K * WIDTH // (2 if kind == "Q4_1" else 1))


def _natural_order(xp, v, kind: str):
  """The inverse of `_value_order`: [..., B values] -> [..., 32 k, 64 c]."""
  lead = v.shape[:-1]
  n = len(lead)
  if kind == "Q4_1":
    v = v.reshape(*lead, 8, 2, 16, 4)  # [j, h, i, r]
    q = xp.stack([v & 15, v >> 4], axis=n + 2)  # [j, h, hi, i, r]
    q = xp.transpose(q, (*range(n), n, n + 4, n + 1, n + 2, n + 3))  # [j, r, h, hi, i]
  else:
    v = (v ^ 0x80).reshape(*lead, 8, 4, 16, 4)  # [j, g, i, r]
    q = xp.transpose(v, (*range(n), n, n + 3, n + 1, n + 2))  # [j, r, g, i]
  return q.reshape(*lead, QUANT_K, WIDTH)


def quantize_q8_0(w_KN) -> jax.Array:
  """A float [K, N] weight quantised as GGUF's Q8_0 quantises it (per 32 k of a column, a
  float16 scale max |w| / 127 and 8-bit values), as block-quantised panels (`pack_blocks`)."""
  import gguf

  k, n = w_KN.shape
  rows = np.ascontiguousarray(np.asarray(w_KN, np.float32).T)
  raw = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
  return jnp.asarray(pack_blocks(raw, "Q8_0", k, n))


def dequantize(w_PBQ: jax.Array) -> jax.Array:
  """Block-quantised panels [..., P, K/32, B] uint8 -> float32 panels [..., P, K, 64], the
  weights GGUF's dequantisation gives, bit for bit (d q is exact; d q + m rounds once)."""
  *lead, nb, size = w_PBQ.shape
  kind = _block_kind(size)
  scales, q = _split(w_PBQ)

  def as_f32(s):  # [..., nb, 4, 64] bytes -> [..., nb, 1, 64] float32
    return lax.bitcast_convert_type(jnp.swapaxes(s, -1, -2), jnp.float32)[..., None, :]

  if kind == "Q4_1":
    w = as_f32(scales[0]) * q.astype(jnp.float32) + as_f32(scales[1])
  else:
    w = as_f32(scales[0]) * lax.bitcast_convert_type(q, jnp.int8).astype(jnp.float32)
  return w.reshape(*lead, nb * QUANT_K, WIDTH)


def take_columns(w_PBQ: jax.Array, ids: jax.Array) -> jax.Array:
  """Columns `ids` [V] of block-quantised panels [P, K/32, B], as block-quantised panels of
  their own, [ceil(V / 64), K/32, B]: the same blocks (a restricted LM head of a quantised one)."""
  nb = w_PBQ.shape[1]
  v = ids.shape[0]
  p2 = math.ceil(v / WIDTH)
  ids = jnp.pad(ids, (0, p2 * WIDTH - v))  # padding columns repeat column 0; products drop them
  panel, column = ids // WIDTH, ids % WIDTH

  def gather(part):  # [P, nb, ..., 64] -> [P2, nb, ..., 64], columns ids
    x = jnp.moveaxis(part, -1, 1)[panel, column]  # [V, nb, ...]
    return jnp.moveaxis(x.reshape(p2, WIDTH, nb, *part.shape[2:-1]), 1, -1)

  scales, q = _split(w_PBQ)
  return _join([gather(s) for s in scales], gather(q))


def _block_kind(size: int) -> str:
  return {v: t for t, v in BLOCK_BYTES.items()}[size]


def _split(w_PBQ: jax.Array) -> tuple[list[jax.Array], jax.Array]:
  """Block-quantised panels -> (their float32 scales (Q4_1: and minimums) as bytes, each
  [..., nb, 4, 64]; their values [..., nb, 32, 64] uint8: Q4_1's 0..15, Q8_0's int8 bits)."""
  *lead, nb, size = w_PBQ.shape
  kind = _block_kind(size)
  count = 2 if kind == "Q4_1" else 1
  scales = [
    jnp.swapaxes(
      w_PBQ[..., 4 * WIDTH * i : 4 * WIDTH * (i + 1)].reshape(*lead, nb, WIDTH, 4), -1, -2
    )
    for i in range(count)
  ]
  return scales, _natural_order(jnp, w_PBQ[..., 4 * WIDTH * count :], kind)


def _join(scales: list[jax.Array], q: jax.Array) -> jax.Array:
  """The inverse of `_split`."""
  *lead, nb, _, _ = q.shape
  kind = "Q4_1" if len(scales) == 2 else "Q8_0"
  parts = [jnp.swapaxes(s, -1, -2) for s in scales] + [_value_order(jnp, q, kind)]
  return jnp.concatenate([x.reshape(*lead, nb, -1) for x in parts], axis=-1)


def floats(w: jax.Array) -> jax.Array:
  """Panels in a float dtype: block-quantised ones dequantised, others as they are."""
  return dequantize(w) if w.dtype == jnp.uint8 else w


def matmul(x_XK: jax.Array, w_PKC: jax.Array, n: int, dtype=None, preferred_element_type=None):
  """x @ W for W stored as panels: [..., K] x [P, K, 64] -> [..., n], computed in `dtype`
  (default: x's), the result in `preferred_element_type` (default: `dtype`).

  On a CPU where the panel kernel is built (`pspec_jax.cpu_kernel`: float32, bfloat16 or
  block-quantised weights), up to `cpu_kernel.MAX_ROWS` rows go to it and more rows (a
  prefill) to XLA's GEMM on the unpacked weight, but for block-quantised weights, whose rows
  all take the kernel's 8-bit arithmetic (in calls of `MAX_ROWS`); without it, and on every other
  device, every product takes XLA's batched dot below. Either way a row's result does not
  depend on how many rows share the call, so a verified tree node computes bit for bit what a
  plain decoding step computes.
  """
  return matmuls(x_XK, [(w_PKC, n)], dtype, preferred_element_type)[0]


def matmuls(x_XK: jax.Array, weights, dtype=None, preferred_element_type=None) -> list:
  """`matmul` of the same x by each (W, n) of `weights`: on the CPU kernel one call for them all
  (up to `cpu_kernel.MAX_WEIGHTS`), which the threads share, with the same results."""
  dtype = dtype or x_XK.dtype
  out_dtype = preferred_element_type or dtype
  *lead, k = x_XK.shape
  x_MK = x_XK.reshape(-1, k)
  m = x_MK.shape[0]
  ws = [w for w, _ in weights]
  ns = [n for _, n in weights]

  def xla(x, *ws):
    return [
      _dot(x.astype(dtype), floats(w).astype(dtype), n, preferred_element_type)
      for w, n in zip(ws, ns, strict=True)
    ]

  kernel = (
    all(w.dtype in _KERNEL_DTYPES for w in ws)
    and len(ws) <= cpu_kernel.MAX_WEIGHTS
    and cpu_kernel.available()
  )
  if kernel:
    if m <= cpu_kernel.MAX_ROWS or any(w.dtype == jnp.uint8 for w in ws):
      # Block-quantised weights take the kernel's arithmetic whatever the rows (a prefill in
      # calls of `MAX_ROWS`), so every row is computed alike.
      def cpu(x, *ws):
        step = cpu_kernel.MAX_ROWS
        parts = [
          cpu_kernel.matmuls(x[i : i + step], list(zip(ws, ns, strict=True)))
          for i in range(0, m, step)
        ]
        return [jnp.concatenate(ys, axis=0).astype(out_dtype) for ys in zip(*parts, strict=True)]
    else:
      # A prefill: compute-bound, where XLA:CPU's GEMM on the plain layout is fastest, even
      # after unpacking (measured 2.4x faster than the batched dot at 512 rows).
      def cpu(x, *ws):
        return [
          jnp.matmul(
            x.astype(dtype),
            unpack(floats(w), n).astype(dtype),
            preferred_element_type=preferred_element_type,
          )
          for w, n in zip(ws, ns, strict=True)
        ]

    ys = cpu_kernel.platform_dependent(x_MK, *ws, cpu=cpu, default=xla)
  else:
    ys = xla(x_MK, *ws)
  return [y.reshape(*lead, n) for y, n in zip(ys, ns, strict=True)]


_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint8))


def _dot(x_MK: jax.Array, w_PKC: jax.Array, n: int, preferred_element_type) -> jax.Array:
  """XLA's panel product: a dot batched over the panels, x broadcast to each.

  A single row is padded to two: XLA:CPU gives one row its own matrix-vector kernel, which
  sums in another order than YNNPACK does for two rows or more. Padded, a row's result does
  not depend on how many rows share the call, and the padding costs nothing measurable.
  """
  m = x_MK.shape[0]
  p = w_PKC.shape[0]
  if m == 1:
    x_MK = jnp.pad(x_MK, ((0, 1), (0, 0)))
  x_PMK = jnp.broadcast_to(x_MK[None], (p, *x_MK.shape))
  y_PMC = lax.dot_general(
    x_PMK,
    w_PKC,
    dimension_numbers=(((2,), (1,)), ((0,), (0,))),
    preferred_element_type=preferred_element_type,
  )
  y_MN = jnp.swapaxes(y_PMC, 0, 1).reshape(x_MK.shape[0], p * WIDTH)
  return y_MN[:m, :n]
