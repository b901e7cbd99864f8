"""Array helpers shared by the library."""

import jax.numpy as jnp

__all__ = ["take_rows"]


def take_rows(x_BM, index_BP):
  """x[b, index[b, p]] along axis 1, any trailing dims."""
  index = index_BP.reshape(index_BP.shape + (1,) * (x_BM.ndim - 2))
  return jnp.take_along_axis(x_BM, index, axis=1)
