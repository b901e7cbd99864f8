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
    the caller guarantees lengths[b] + T <= max_len, which `decode` checks up front, because
    `dynamic_update_slice` would silently shift an out-of-range write.
    """
    k_new, v_new = kv_LBTKH

    def put(cache_LBSKH, new_LBTKH):
      # vmap over the batch axis: every sequence writes at its own offset.
      def one(c_LSKH, n_LTKH, start):
        return jax.lax.dynamic_update_slice(c_LSKH, n_LTKH.astype(c_LSKH.dtype), (0, start, 0, 0))

      return jax.vmap(one, in_axes=(1, 1, 0), out_axes=1)(cache_LBSKH, new_LBTKH, self.lengths)

    return KVCache(
      k=put(self.k, k_new),
      v=put(self.v, v_new),
      lengths=self.lengths + advance_B.astype(jnp.int32),
    )
