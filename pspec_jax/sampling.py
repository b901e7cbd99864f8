"""Token selection from target logits: greedy, or temperature / top-k / top-p sampling.

`filtered_logits` defines *the* target distribution at T > 0; speculative acceptance must use
the same function so that its output distribution equals plain sampling's.

Vocabulary-sized rows are slow on XLA:CPU, which reduces a row one element at a time and draws
Gumbel noise of the row's length for a sample. Where JAX's default backend is the CPU and the
CPU kernels are built, `argmax` and every draw (`categorical`, `draws`) are kernel calls
(`cpu_kernel.argmax`, `cpu_kernel.draws`: inverse-CDF draws from a few random bits per draw);
elsewhere Gumbel-max and Gumbel-top-k. Both draw from the same law; for a given key they draw
different tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pspec_jax import cpu_kernel

__all__ = [
  "SamplingConfig",
  "argmax",
  "categorical",
  "draws",
  "filtered_logits",
  "noise",
  "select",
  "softmax",
  "uses_cpu_kernel",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """temperature 0 is greedy (argmax); top_k 0 and top_p 1 disable those filters."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def filtered_logits(logits_BV: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Tempered float32 logits with tokens outside top-k / top-p set to -inf."""
  logits = logits_BV.astype(jnp.float32) / cfg.temperature
  neg_inf = jnp.float32(-jnp.inf)
  if cfg.top_k:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, neg_inf, logits)
  if cfg.top_p < 1:
    sorted_desc = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays iff the mass strictly
    # before it is < top_p (so the most probable token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_keep = jnp.sum(mass_before < cfg.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_desc, num_keep - 1, axis=-1)
    logits = jnp.where(logits < threshold, neg_inf, logits)
  return logits


def uses_cpu_kernel() -> bool:
  """Whether vocabulary rows go to the CPU kernels: decided when tracing, since the two ways
  draw from different random numbers (`noise`)."""
  return jax.default_backend() == "cpu" and cpu_kernel.available()


def argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first index of the maximum), as int32. Rows must hold
  no NaN. Without the kernel, two plain reductions: XLA:CPU's fused index-and-value reduction
  costs 0.2 ms per 49k-token row, this a seventh of it (the kernel a thirtieth)."""
  if uses_cpu_kernel():
    return cpu_kernel.argmax(x)
  best = jnp.max(x, axis=-1, keepdims=True)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x == best, index, x.shape[-1] - 1), axis=-1)


def softmax(x: jax.Array) -> jax.Array:
  """jax.nn.softmax over the last axis of float32 logits (a row of -inf only: zeros with the
  kernel)."""
  if uses_cpu_kernel():
    return cpu_kernel.softmax(x)
  return jax.nn.softmax(x, axis=-1)


def noise(key: jax.Array, shape: tuple[int, ...], num: int = 1) -> jax.Array:
  """The random numbers of `num` draws from each row of logits of `shape` (`draws`): random
  bits [..., num, 2] for the kernel, else Gumbel noise of the logits' shape (num = 1 only)."""
  if uses_cpu_kernel():
    return jax.random.bits(key, (*shape[:-1], num, 2), jnp.uint32)
  if num != 1:
    raise ValueError("Gumbel noise serves one draw per row")
  return jax.random.gumbel(key, shape, jnp.float32)


def draws(key: jax.Array, logits: jax.Array, num: int) -> jax.Array:
  """`num` draws from softmax over the last axis of `logits`, without replacement, in the order
  drawn: [..., num] int32 (Gumbel-top-k's law; a -inf logit is drawn only once no finite one is
  left: then the kernel repeats its last draw, XLA's path takes -inf tokens)."""
  if uses_cpu_kernel():
    return cpu_kernel.draws(logits, noise(key, logits.shape, num))
  return jax.lax.top_k(logits + jax.random.gumbel(key, logits.shape, logits.dtype), num)[1]


def categorical(key: jax.Array, logits: jax.Array, drawn_noise: jax.Array | None = None):
  """One draw per row from softmax over the last axis (the law of jax.random.categorical):
  [...] int32, with `noise(key, logits.shape)`, or with `drawn_noise` if drawn already."""
  if drawn_noise is None:
    drawn_noise = noise(key, logits.shape)
  if uses_cpu_kernel():
    return cpu_kernel.draws(logits, drawn_noise)[..., 0]
  return argmax(logits + drawn_noise)


def select(logits_BV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Next token ids [B]: argmax when greedy, else a sample of the filtered distribution."""
  if cfg.greedy:
    return argmax(logits_BV)
  return categorical(key, filtered_logits(logits_BV, cfg))
