"""The frozen target's features of a token dataset, computed once and kept on disk.

A drafter's train step spends most of its time in the target's forward pass when the target
is much larger than the drafter and the data is seen many times (several epochs, or several
drafters trained on one dataset). With `data.cache_features`, `train.distill` runs the target
over every row once and trains from the stored features ([N, S, D] float32, memory-mapped; for a
drafter with `feature_layers` [N, S, D + E]: f, then the hidden states h it reads, from the same
pass); the result is the same as running the target inside every step. The file is keyed by the rows
and the target, so any change to either computes it afresh; a killed computation leaves no
partial file behind.
"""

import hashlib
import os

import jax
import numpy as np
from tqdm import tqdm

from pspec_jax import data, losses
from pspec_jax.llama import Target


def _key(token_data: data.TokenData, target: Target, feature_layers: tuple[int, ...]) -> str:
  digest = hashlib.sha256()
  if feature_layers:  # files of the final feature alone keep their names
    digest.update(repr(feature_layers).encode())
  for array in (token_data.tokens, token_data.segments):
    digest.update(np.ascontiguousarray(array).tobytes())
  digest.update(repr(target.cfg).encode())
  for leaf in jax.tree.leaves(target.params)[:4]:  # the same architecture, other weights
    digest.update(np.asarray(leaf).ravel()[:64].tobytes())
  return digest.hexdigest()[:16]


def target_features(
  token_data: data.TokenData,
  target: Target,
  cache_dir: str,
  batch_size: int = 8,
  feature_layers: tuple[int, ...] = (),
) -> np.ndarray:
  """The target's features of every row of `token_data`: a read-only [N, S, D] map of
  `cache_dir/features-<key>.npy` (with `feature_layers`, [N, S, D + E]: the final features,
  then those layers' hidden states), computed (with a progress bar) when not there yet."""
  feature_layers = tuple(feature_layers)
  path = os.path.join(cache_dir, f"features-{_key(token_data, target, feature_layers)}.npy")
  if not os.path.exists(path):
    os.makedirs(cache_dir, exist_ok=True)
    n, s = token_data.tokens.shape
    partial = path + ".partial.npy"
    width = target.cfg.hidden_size * (1 + len(feature_layers))
    out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, s, width))

    @jax.jit
    def forward(params, tokens, segments):
      positions = losses.segment_positions(segments)
      mask = losses.segment_mask(segments)
      got = Target(cfg=target.cfg, params=params)(tokens, positions, None, mask, feature_layers)
      return jax.numpy.concatenate([got[0], got[2]], -1) if feature_layers else got[0]

    for lo in tqdm(range(0, n, batch_size), desc="target features", unit="batch"):
      rows = np.arange(lo, lo + batch_size) % n  # the last batch wraps: one compiled shape
      got = forward(target.params, token_data.tokens[rows], token_data.segments[rows])
      out[lo : lo + batch_size] = np.asarray(got, np.float32)[: n - lo]
    out.flush()
    del out
    os.replace(partial, path)
  return np.load(path, mmap_mode="r")
