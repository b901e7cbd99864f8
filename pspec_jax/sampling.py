"""Token selection from target logits: greedy, or temperature / top-k / top-p sampling.

`filtered_logits` defines *the* target distribution at T > 0; speculative acceptance must use
the same function so that its output distribution equals plain sampling's.
"""

import dataclasses

import jax
import jax.numpy as jnp


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


def select(logits_BV: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Next token ids [B]: argmax when greedy, else a sample of the filtered distribution."""
  if cfg.greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits_BV, cfg), axis=-1).astype(jnp.int32)
