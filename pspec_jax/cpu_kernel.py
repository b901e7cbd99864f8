"""The CPU kernels of decoding: x @ W for W in 64-column panels, a few rows at one row's cost,
a layer's attention over the key/value cache in one pass, and vocabulary-sized rows (`argmax`,
`softmax`, `draws`, and `rejection`: a level of speculative sampling's walk) in a few vector
passes.

Optional XLA FFI custom calls (`csrc/cpu_kernels.cc`) on XLA:CPU (docs/design.md section 7):
`matmul` for `panels.matmul`'s small-M products, `attention` for a decoding step's or a tree
verification's attention (`layers.attend`). YNNPACK, which XLA:CPU gives every product of
two rows or more, reads a panel as one stream but loses it again from about 6 rows on, and its
one-row product is no faster than the plain layout's. The kernel streams each panel once,
whatever the number of rows (up to `MAX_ROWS`), on every core: a thread takes a panel, reads it
in blocks that stay in L1 and multiplies every row by each block. Each output element is one
fused multiply-add per k in k order, so a row's result does not depend on how many rows share
the call: a verified tree node computes bit for bit what a plain decoding step computes. A GGUF
weight can stay in its Q4_1 or Q8_0 blocks (`panels.pack_blocks`), multiplied as llama.cpp
multiplies them: each row of x quantised to 8 bits per 32 k, exact integer dot products with the
4- or 8-bit values (AVX-512 VNNI where the CPU has it, and AMX's tiles for 9 to 16 rows where it
has those), then one float update per block; again
a row's result is its own, and the same on every instruction set.

XLA splits a decoding step's attention into a dozen small dots and reductions that read the
cache in pieces (at batch 32, 5-10x slower than reading it once). `attention` runs rows over the
keys and values they see (on AVX-512 several rows of a key/value head at once, so each is read
once for them all), skips cache slots past a sequence's length, and keeps the same row
independence: a tree node attends bit for bit as a plain step does.

The kernel is C++ built from source on this machine (`build`; `make setup` runs it, and the
first use builds it where a compiler exists), kept under `pspec_jax.cache_dir("kernels")`
keyed by its source, the compiler and JAX's FFI headers. Where it cannot be built, or with
`PSPEC_JAX_CPU_KERNEL=off`, `panels.matmul` takes its pure-JAX path, and everything still runs.
Environment: `PSPEC_JAX_CPU_KERNEL_THREADS` (default: the usable cores, at most 8),
`PSPEC_JAX_CPU_KERNEL_ISA` (`avx512`: not AMX's tiles where the CPU has them; `avx2`: not AVX-512
either; `portable`: the C++ path instead of any; for tests and comparisons) and
`PSPEC_JAX_CPU_KERNEL_READ_AHEAD` (bytes of the next product's weights the idle kernel threads
bring into cache while XLA computes between products; default: a core's L2, 0: none;
`read_ahead` sets it in a running process).
"""

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np

import pspec_jax

__all__ = [
  "MAX_ROWS",
  "MAX_WEIGHTS",
  "argmax",
  "attention",
  "available",
  "build",
  "describe",
  "disabled",
  "draws",
  "library_path",
  "matmul",
  "matmuls",
  "platform_dependent",
  "read_ahead",
  "rejection",
  "rope_cos_sin",
  "softmax",
]

MAX_ROWS = 64  # csrc/cpu_kernels.cc kMaxRows: more rows are a prefill, left to XLA
MAX_WEIGHTS = 4  # kMaxWeights: weights one `matmuls` call multiplies
_TARGET = "pspec_panel_matmul"
_ATTENTION = "pspec_decode_attention"
_ARGMAX = "pspec_vocab_argmax"
_DRAWS = "pspec_vocab_draws"
_SOFTMAX = "pspec_vocab_softmax"
_REJECTION = "pspec_vocab_rejection"
_ROPE = "pspec_rope_cos_sin"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-pthread")


def _source() -> bytes:
  return (resources.files("pspec_jax") / "csrc" / "cpu_kernels.cc").read_bytes()


def _compiler() -> str | None:
  cxx = os.environ.get("CXX")
  return shutil.which(cxx) if cxx else shutil.which("g++") or shutil.which("c++")


@functools.cache
def _build_hash() -> str | None:
  """The build's identity: source, compiler, XLA's FFI headers and flags, hashed (None: no C++
  compiler found). Once per process, as the library itself is loaded once (`_library`): the id
  `build_id` reports is the loaded build's, with no compiler run per call."""
  cxx = _compiler()
  if cxx is None:
    return None
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
  key = hashlib.sha256()
  for part in (_source(), version.encode(), jax.ffi.include_dir().encode(), str(_FLAGS).encode()):
    key.update(part)
  return key.hexdigest()[:16]


def library_path() -> str | None:
  """Where this machine's build of the kernel lives (None: no C++ compiler found)."""
  build = _build_hash()
  if build is None:
    return None
  return os.path.join(pspec_jax.cache_dir("kernels"), f"cpu_kernels-{build}.so")


def build() -> str:
  """Compiles the kernel for this machine if it is not built yet; returns the library's path.

  Raises:
    RuntimeError: no C++ compiler, or the compiler failed (its message included).
  """
  path = library_path()
  if path is None:
    raise RuntimeError("no C++ compiler (g++, c++ or $CXX) to build the CPU panel kernel")
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
    src = os.path.join(tmp, "cpu_kernels.cc")
    with open(src, "wb") as f:
      f.write(_source())
    out = os.path.join(tmp, "cpu_kernels.so")
    cmd = [_compiler(), *_FLAGS, f"-I{jax.ffi.include_dir()}", src, "-o", out]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"building the CPU panel kernel failed: {done.stderr.strip()}")
    os.replace(out, path)  # atomic: a reader never sees half a library
  return path


@functools.cache
def _library() -> ctypes.CDLL | None:
  if os.environ.get("PSPEC_JAX_CPU_KERNEL", "auto").lower() in ("off", "0", "false", "no"):
    return None
  try:
    lib = ctypes.CDLL(build())
  except (RuntimeError, OSError) as e:
    logging.getLogger(__name__).warning("CPU panel kernel unavailable, using XLA: %s", e)
    return None
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.PanelMatmul), platform="cpu")
  jax.ffi.register_ffi_target(_ATTENTION, jax.ffi.pycapsule(lib.DecodeAttention), platform="cpu")
  jax.ffi.register_ffi_target(_ARGMAX, jax.ffi.pycapsule(lib.VocabArgmax), platform="cpu")
  jax.ffi.register_ffi_target(_DRAWS, jax.ffi.pycapsule(lib.VocabDraws), platform="cpu")
  jax.ffi.register_ffi_target(_SOFTMAX, jax.ffi.pycapsule(lib.VocabSoftmax), platform="cpu")
  jax.ffi.register_ffi_target(_REJECTION, jax.ffi.pycapsule(lib.VocabRejection), platform="cpu")
  jax.ffi.register_ffi_target(_ROPE, jax.ffi.pycapsule(lib.RopeCosSin), platform="cpu")
  lib.pspec_panel_matmul_isa.restype = ctypes.c_char_p
  lib.pspec_read_ahead_bytes.restype = ctypes.c_int64
  lib.pspec_read_ahead_bytes.argtypes = [ctypes.c_int64]
  return lib


_off = False  # set by `disabled`


def available() -> bool:
  """Whether `panels.matmul` uses the kernel: it is built (or builds now), not turned off."""
  return not _off and _library() is not None


@contextlib.contextmanager
def disabled():
  """Panel products take XLA's path inside (as where the kernel is not built), to compare the
  two in one process. Programs compiled before are dropped on entry and exit."""
  global _off
  jax.clear_caches()
  _off = True
  try:
    yield
  finally:
    _off = False
    jax.clear_caches()


def platform_dependent(*args, cpu, default):
  """`lax.platform_dependent(*args, cpu=cpu, default=default)`, which traces both branches and
  keeps the one of the platform it lowers for. Where the CPU is JAX's only platform (its
  default backend), nothing can lower for another, so the CPU branch is traced alone: tracing
  every product of a decoding program twice took a third of its tracing time."""
  if jax.default_backend() == "cpu":
    return cpu(*args)
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


def describe() -> str:
  """One line on the kernel in use, for reports: its instruction set and threads, or why not."""
  if not available():
    return "XLA (no CPU kernels)"
  lib = _library()
  isa, threads = lib.pspec_panel_matmul_isa().decode(), lib.pspec_panel_matmul_threads()
  return f"CPU kernels ({isa}, {threads} threads, read-ahead {read_ahead() >> 10} KB)"


def read_ahead(num_bytes: int | None = None) -> int:
  """The kernel threads' read-ahead budget in bytes (csrc/cpu_kernels.cc, "Read-ahead"): set to
  `num_bytes` if given (0: none), for comparisons within one process; returns the budget before.
  A prefetch only moves memory into cache: no result depends on it."""
  if num_bytes is not None and num_bytes < 0:
    raise ValueError(f"read-ahead must be >= 0 bytes, got {num_bytes}")
  if not available():
    raise RuntimeError("the CPU kernels are not available")
  return _library().pspec_read_ahead_bytes(-1 if num_bytes is None else num_bytes)


def build_id() -> str:
  """Which build of the kernel runs ("" where none does): its source, compiler and flags,
  hashed. Costs timed with one build do not hold for another (`infer.calibration`)."""
  return _build_hash() if available() else ""


def matmul(x_MK: jax.Array, w_PKC: jax.Array, n: int) -> jax.Array:
  """x @ W with the kernel: [M, K] x [P, K, 64] (float32 or bfloat16), or block-quantised
  panels [P, K/32, B] uint8 (`panels.pack_blocks`, x then quantised to 8 bits per 32 k), ->
  [M, n] float32.

  Call only where `available()` and on a CPU (`panels.matmul` does both checks).
  """
  return matmuls(x_MK, [(w_PKC, n)])[0]


def matmuls(x_MK: jax.Array, weights) -> list[jax.Array]:
  """x @ W for each (W, n) of `weights` (1 to `MAX_WEIGHTS`) in one kernel call: [M, n] float32
  each, every one as `matmul` computes it alone; the threads share all their panels."""
  if _library() is None:
    raise RuntimeError("the CPU kernels are not available")
  m = x_MK.shape[0]
  if not 1 <= m <= MAX_ROWS:
    raise ValueError(f"the CPU panel kernel takes 1 to {MAX_ROWS} rows, got {m}")
  if not 1 <= len(weights) <= MAX_WEIGHTS:
    raise ValueError(f"the CPU panel kernel takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
  out = [jax.ShapeDtypeStruct((m, n), jnp.float32) for _, n in weights]
  call = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")
  return list(call(x_MK.astype(jnp.float32), *(w for w, _ in weights)))


def attention(q_BTKGH, k_BSKH, v_BSKH, cache_len_B, k_BTKH, v_BTKH, mask_BTT, scale: float):
  """One layer's attention for T new tokens, float32: [B, T, KV, G, H].

  Query (t, kv head, group) attends to cache slots s < cache_len[b] of its head and to new
  token u where mask[b, t, u], with softmax(q . k * scale); a query that sees nothing averages
  every slot (XLA's masked softmax). Call only where `available()` and on a CPU
  (`layers.attend` does both checks).
  """
  if _library() is None:
    raise RuntimeError("the CPU kernels are not available")
  f32 = lambda x: x.astype(jnp.float32)
  out = jax.ShapeDtypeStruct(q_BTKGH.shape, jnp.float32)
  return jax.ffi.ffi_call(_ATTENTION, out, vmap_method="sequential")(
    f32(q_BTKGH),
    f32(k_BSKH),
    f32(v_BSKH),
    cache_len_B.astype(jnp.int32),
    f32(k_BTKH),
    f32(v_BTKH),
    mask_BTT.astype(jnp.bool_),
    scale=np.float32(scale),
  )


def rope_cos_sin(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) of float32 angles, the C library's cosf and sinf: the bits of `jnp.cos` and
  `jnp.sin` on XLA:CPU, which calls them. Opaque to XLA, so the values are computed once:
  identical calls (every layer's q and k) merge into one, where XLA fused `jnp.cos` into each
  rotation and computed it again for every head."""
  if _library() is None:
    raise RuntimeError("the CPU kernels are not available")
  out = jax.ShapeDtypeStruct(angles.shape, jnp.float32)
  call = jax.ffi.ffi_call(_ROPE, (out, out), vmap_method="broadcast_all")
  return tuple(call(angles.astype(jnp.float32)))


def _vocab(x_XV: jax.Array) -> jax.Array:
  """Float32 logits with a vocabulary axis last. The kernels take any leading axes as rows, so
  under vmap the batch is more rows of one call (`vmap_method="broadcast_all"`)."""
  if _library() is None:
    raise RuntimeError("the CPU kernels are not available")
  if x_XV.ndim < 1 or x_XV.shape[-1] < 1:
    raise ValueError(f"a vocabulary axis of at least one logit is needed, got {x_XV.shape}")
  return x_XV.astype(jnp.float32)


def _vocab_call(target, out_shape, dtype):
  return jax.ffi.ffi_call(
    target, jax.ShapeDtypeStruct(out_shape, dtype), vmap_method="broadcast_all"
  )


def argmax(x_XV: jax.Array) -> jax.Array:
  """The first index of each row's maximum over the last axis, int32 (as jnp.argmax; rows hold
  no NaN): a vectorised max, then a vectorised search for its first place."""
  x = _vocab(x_XV)
  return _vocab_call(_ARGMAX, x.shape[:-1], jnp.int32)(x)


def draws(x_XV: jax.Array, bits_XD2: jax.Array) -> jax.Array:
  """D draws without replacement from softmax over the last axis of the logits `x_XV` (a -inf
  logit is never drawn), in the order drawn: [..., D] int32, the law of Gumbel-top-D.

  `bits_XD2` [..., D, 2] uint32 are the draws' random bits (`jax.random.bits`): draw j takes
  u in [0, 1) from its pair (53 bits) and inverts the distribution function of the tokens not
  drawn yet, their masses exp(x - max x) summed in double (once only logits beyond exp's range
  below the max are left, weighed again against their own max). A row without a finite logit
  draws token 0 (as jax.random.categorical); more draws than finite logits repeat the last."""
  x = _vocab(x_XV)
  if bits_XD2.shape[:-2] != x.shape[:-1] or bits_XD2.shape[-1:] != (2,):
    raise ValueError(f"bits must be [..., D, 2] for logits {x.shape}, got {bits_XD2.shape}")
  d = bits_XD2.shape[-2]
  return _vocab_call(_DRAWS, (*x.shape[:-1], d), jnp.int32)(x, bits_XD2.astype(jnp.uint32))


def softmax(x_XV: jax.Array) -> jax.Array:
  """softmax over the last axis, float32: exp(x - max x) (0 at -inf) over their sum in double.
  A row without a finite logit is all zeros."""
  x = _vocab(x_XV)
  return _vocab_call(_SOFTMAX, x.shape, jnp.float32)(x)


def rejection(x_XV, logq_XV, tokens_XC, from_q_XC, uniform_XC, bits_X2):
  """One level of recursive rejection sampling (`accept`'s walk) per row: (slot [...], bonus
  [...]) int32.

  x_XV: the target's filtered logits at the node; logq_XV: the draft log-distribution its
  drawn children came from; tokens_XC: the children in the order tried (-1: none); from_q_XC:
  whether each was drawn from q (without replacement), else it is a point mass; uniform_XC: one
  uniform per child; bits_X2 [..., 2] uint32: the bonus draw's random bits. With r = softmax(x)
  and pi a child's proposal (q renormalised over the siblings not tried yet, or the point
  mass), child c is accepted iff u_c * sum(r) * pi(x_c) < r(x_c); on rejection r becomes
  max(0, r / sum(r) - pi). slot: the accepted child's, else -1; bonus: if none was accepted,
  a draw from what is left of r (`draws`' inverse CDF with the bits; from softmax(x) if
  rounding emptied it), else -1. A drawn child whose q mass is used up is not tried."""
  x, logq = _vocab(x_XV), _vocab(logq_XV)
  lead, c = x.shape[:-1], tokens_XC.shape[-1:]
  shapes = (logq.shape, tokens_XC.shape, from_q_XC.shape, uniform_XC.shape, bits_X2.shape)
  if shapes != (x.shape, lead + c, lead + c, lead + c, lead + (2,)):
    raise ValueError(
      f"rejection takes x and logq [..., V], tokens, from_q and uniform [..., C], bits [..., 2];"
      f" got {x.shape}, {logq.shape}, {tokens_XC.shape}, {from_q_XC.shape}, "
      f"{uniform_XC.shape}, {bits_X2.shape}"
    )
  out = [jax.ShapeDtypeStruct(lead, jnp.int32)] * 2
  call = jax.ffi.ffi_call(_REJECTION, out, vmap_method="broadcast_all")
  return tuple(
    call(
      x,
      logq,
      tokens_XC.astype(jnp.int32),
      from_q_XC.astype(jnp.int32),
      uniform_XC.astype(jnp.float32),
      bits_X2.astype(jnp.uint32),
    )
  )
