"""Preallocated key/value cache of the target, with per-sequence lengths.

Slot s of sequence b holds the keys and values of that sequence's token s, for every layer.
Slots [0, lengths[b]) are valid; the rest are scratch and never attended to.
"""

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, H]
  v: jax.Array  # [L, B, S, K, H]
  lengths: jax.Array  # [B] int32: valid slots per sequence

  @classmethod
  def zeros(cls, *, num_layers, batch, max_len, num_kv_heads, head_dim, dtype) -> "KVCache":
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return cls(
      k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(self, kv_LBTKH: tuple[jax.Array, jax.Array], advance_B: jax.Array) -> "KVCache":
    """Writes T new entries at slots [lengths[b], lengths[b] + T) and advances lengths.

    All T entries are written (the ones past `advance_B[b]` are scratch beyond the new length);
    entries that would land past `max_len` are dropped (`decode` checks up front that the
    accepted ones never do).
    """
    k_new, v_new = kv_LBTKH
    t = k_new.shape[2]
    rows = jnp.arange(self.k.shape[1])[:, None]
    slots = self.lengths[:, None] + jnp.arange(t)[None, :]

    def put(cache_LBSKH, new_LBTKH):
      # A scatter at [b, lengths[b] + t]: in place, in the cache's own layout (a vmapped
      # dynamic_update_slice made XLA transpose the whole cache on every write).
      return cache_LBSKH.at[:, rows, slots].set(new_LBTKH.astype(cache_LBSKH.dtype), mode="drop")

    return KVCache(
      k=put(self.k, k_new),
      v=put(self.v, v_new),
      lengths=self.lengths + advance_B.astype(jnp.int32),
    )
