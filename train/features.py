"""The frozen target's features of a token dataset, computed once and kept on disk.

A drafter's train step spends most of its time in the target's forward pass when the target
is much larger than the drafter and the data is seen many times (several epochs, or several
drafters trained on one dataset). With `data.cache_features`, `train.distill` runs the target
over every row once and trains from the stored features ([N, S, D] float32, memory-mapped; for a
drafter with `feature_layers` [N, S, D + E]: f, then the hidden states h it reads, from the same
pass); the result is the same as running the target inside every step. The file is keyed by the rows
and the target, so any change to either computes it afresh. A file with feature layers also
serves every drafter whose layers start its list, the final feature alone included (a view of
its first columns): drafters compared on one dataset share one pass of the target. A killed
computation resumes at the first batch it had not written (its partial file and a progress
record sit next to the cache file until it completes).
"""

import hashlib
import json
import os

import jax
import numpy as np
from tqdm import tqdm

from pspec_jax import data, losses
from pspec_jax.llama import Target


def _key(token_data: data.TokenData, target: Target) -> str:
  digest = hashlib.sha256()
  for array in (token_data.tokens, token_data.segments):
    digest.update(np.ascontiguousarray(array).tobytes())
  digest.update(repr(target.cfg).encode())
  for leaf in jax.tree.leaves(target.params)[:4]:  # the same architecture, other weights
    digest.update(np.asarray(leaf).ravel()[:64].tobytes())
  return digest.hexdigest()[:16]


def _name(key: str, feature_layers: tuple[int, ...]) -> str:
  layers = "".join(f"-{layer}" for layer in feature_layers)
  return f"features-{key}{'-layers' if layers else ''}{layers}.npy"


def _stored(cache_dir: str, key: str, feature_layers: tuple[int, ...]) -> str | None:
  """A complete file of these rows whose layers start with `feature_layers`, if any."""
  exact = os.path.join(cache_dir, _name(key, feature_layers))
  if os.path.exists(exact):
    return exact
  prefix = f"features-{key}-layers-"
  for name in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else ():
    if not (name.startswith(prefix) and name.endswith(".npy")) or ".partial" in name:
      continue
    try:
      layers = tuple(int(x) for x in name[len(prefix) : -len(".npy")].split("-"))
    except ValueError:
      continue
    if layers[: len(feature_layers)] == feature_layers:
      return os.path.join(cache_dir, name)
  return None


def _write_progress(progress: str, record: dict) -> None:
  with open(progress + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(progress + ".tmp", progress)


def _resume(partial: str, progress: str, shape: tuple):
  """The partial file to write into and the first row still to compute: where a killed
  computation stopped, or a fresh file at row 0."""
  try:
    with open(progress) as f:
      record = json.load(f)
    rows = int(record["rows"])
    if tuple(record["shape"]) == shape and 0 <= rows <= shape[0]:
      out = np.lib.format.open_memmap(partial, mode="r+")
      if out.shape == shape and out.dtype == np.float32:
        return out, rows
  except (OSError, ValueError, KeyError, TypeError):
    pass  # none, or not one this computation can continue: start over
  out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=shape)
  _write_progress(progress, dict(shape=list(shape), rows=0))
  return out, 0


def target_features(
  token_data: data.TokenData,
  target: Target,
  cache_dir: str,
  batch_size: int = 8,
  feature_layers: tuple[int, ...] = (),
) -> np.ndarray:
  """The target's features of every row of `token_data`: a read-only [N, S, D] map of
  `cache_dir/features-<key>.npy` (with `feature_layers`, [N, S, D + E]: the final features,
  then those layers' hidden states), computed (with a progress bar) when neither it nor a file
  with more layers after these is there yet."""
  feature_layers = tuple(feature_layers)
  key = _key(token_data, target)
  width = target.cfg.hidden_size * (1 + len(feature_layers))
  path = _stored(cache_dir, key, feature_layers)
  if path is None:
    path = os.path.join(cache_dir, _name(key, feature_layers))
    os.makedirs(cache_dir, exist_ok=True)
    n, s = token_data.tokens.shape
    shape = (n, s, width)
    partial, progress = path + ".partial.npy", path + ".partial.json"
    out, start = _resume(partial, progress, shape)

    @jax.jit
    def forward(params, tokens, segments):
      positions = losses.segment_positions(segments)
      mask = losses.segment_mask(segments)
      got = Target(cfg=target.cfg, params=params)(tokens, positions, None, mask, feature_layers)
      return jax.numpy.concatenate([got[0], got[2]], -1) if feature_layers else got[0]

    total = -(-n // batch_size)
    bar = tqdm(total=total, initial=start // batch_size, desc="target features", unit="batch")
    for lo in range(start, n, batch_size):
      rows = np.arange(lo, lo + batch_size) % n  # the last batch wraps: one compiled shape
      got = forward(target.params, token_data.tokens[rows], token_data.segments[rows])
      out[lo : lo + batch_size] = np.asarray(got, np.float32)[: n - lo]
      out.flush()  # the rows are on disk before the progress file says so
      _write_progress(progress, dict(shape=list(shape), rows=min(lo + batch_size, n)))
      bar.update()
    bar.close()
    del out
    os.replace(partial, path)
    os.remove(progress)
  return np.load(path, mmap_mode="r")[..., :width]
