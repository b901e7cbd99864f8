"""Preallocated key/value cache of the target, with per-sequence lengths.

Slot s of sequence b holds the keys and values of that sequence's token s, for every layer.
Slots [0, lengths[b]) are valid; the rest are scratch and never attended to.

Two layouts of the same cache: one [B, S, K, H] buffer per layer (`per_layer`, for models that
loop over their layers), or one stacked [L, B, S, K, H] buffer (for a target with scanned
layers, whose scan slices it). A layer read out of a stacked buffer outside a scan is a copy
of it; on a CPU at batch 32 those copies cost several times the attention itself.
"""

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["KVCache"]


@struct.dataclass
class KVCache:
  k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, K, H], or L arrays [B, S, K, H]
  v: jax.Array | tuple[jax.Array, ...]
  lengths: jax.Array  # [B] int32: valid slots per sequence

  @classmethod
  def zeros(
    cls, *, num_layers, batch, max_len, num_kv_heads, head_dim, dtype, per_layer=True
  ) -> "KVCache":
    shape = (batch, max_len, num_kv_heads, head_dim)
    if per_layer:
      k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
      v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    else:
      k, v = jnp.zeros((num_layers, *shape), dtype), jnp.zeros((num_layers, *shape), dtype)
    return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1] if self.per_layer else self.k.shape[2]

  def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
    """Layer i's keys and values, [B, S, K, H] each."""
    return self.k[i], self.v[i]

  def stacked(self) -> tuple[jax.Array, jax.Array]:
    """Keys and values of every layer, [L, B, S, K, H] each (a copy for a per-layer cache)."""
    if self.per_layer:
      return jnp.stack(self.k), jnp.stack(self.v)
    return self.k, self.v

  def write(self, kv_LBTKH: tuple[jax.Array, jax.Array], advance_B: jax.Array) -> "KVCache":
    """Writes T new entries at slots [lengths[b], lengths[b] + T) and advances lengths.

    All T entries are written (the ones past `advance_B[b]` are scratch beyond the new length);
    entries that would land past `max_len` are dropped (`decode` checks up front that the
    accepted ones never do).
    """
    k_new, v_new = kv_LBTKH
    t = k_new.shape[2]
    rows = jnp.arange(self.lengths.shape[0])[:, None]
    slots = self.lengths[:, None] + jnp.arange(t)[None, :]

    def put(cache_BSKH, new_BTKH):
      # A scatter at [b, lengths[b] + t]: in place, in the cache's own layout (a vmapped
      # dynamic_update_slice made XLA transpose the whole cache on every write).
      return cache_BSKH.at[rows, slots].set(new_BTKH.astype(cache_BSKH.dtype), mode="drop")

    if self.per_layer:
      k = tuple(put(c, k_new[i]) for i, c in enumerate(self.k))
      v = tuple(put(c, v_new[i]) for i, c in enumerate(self.v))
    else:  # the same scatter under the leading layers axis
      k = self.k.at[:, rows, slots].set(k_new.astype(self.k.dtype), mode="drop")
      v = self.v.at[:, rows, slots].set(v_new.astype(self.v.dtype), mode="drop")
    return KVCache(k=k, v=v, lengths=self.lengths + advance_B.astype(jnp.int32))
