"""The target's features cache (train/features.py): a killed computation resumes."""

import json

import jax
import numpy as np
import pytest

from pspec_jax import data, testing
from train import features


def _rows(n=5, length=16):
  tokens = jax.random.randint(jax.random.key(5), (n, length), 0, testing.TINY.vocab_size)
  segments = np.where(np.arange(length) < length // 2, 1, 2) * np.ones((n, 1), np.int32)
  return data.TokenData(
    tokens=np.asarray(tokens, np.int32),
    loss_mask=np.ones((n, length), bool),
    segments=segments.astype(np.int32),
  )


class _Killed(Exception):
  pass


def test_a_killed_computation_resumes_at_the_first_batch_it_had_not_written(tmp_path, monkeypatch):
  target = testing.make_target(3.0).with_scan_layers(True)
  rows = _rows()  # 5 rows in batches of 2: rows 0-1, 2-3 and 4 (wrapping)
  whole = features.target_features(rows, target, str(tmp_path / "whole"), 2)

  written = []
  keep = features._write_progress

  def record(progress, row):
    written.append(row["rows"])
    if len(written) == 3:  # the second batch's rows are computed; killed before its record
      raise _Killed
    keep(progress, row)

  monkeypatch.setattr(features, "_write_progress", record)
  cache = tmp_path / "killed"
  with pytest.raises(_Killed):
    features.target_features(rows, target, str(cache), 2)
  (progress,) = cache.glob("*.partial.json")
  assert json.loads(progress.read_text())["rows"] == 2  # what the disk holds for certain

  written.clear()
  again = features.target_features(rows, target, str(cache), 2)
  assert written == [4, 5]  # batches 2-3 and 4 only: batch 0-1 was not computed again
  assert np.array_equal(again, whole)
  assert [p.name for p in cache.iterdir()] == [f"features-{features._key(rows, target)}.npy"]


def test_a_damaged_progress_record_starts_over(tmp_path):
  target = testing.make_target(3.0).with_scan_layers(True)
  rows = _rows()
  whole = features.target_features(rows, target, str(tmp_path / "whole"), 2)
  cache = tmp_path / "damaged"
  cache.mkdir()
  name = f"features-{features._key(rows, target)}.npy"
  (cache / (name + ".partial.json")).write_text("{not json")
  (cache / (name + ".partial.npy")).write_bytes(b"cut short")
  got = features.target_features(rows, target, str(cache), 2)
  assert np.array_equal(got, whole)
  assert sorted(p.name for p in cache.iterdir()) == [name]


def test_a_file_with_more_layers_serves_the_drafters_whose_layers_start_it(tmp_path):
  target = testing.make_target(3.0).with_scan_layers(True)
  rows = _rows()
  d = testing.TINY.hidden_size
  cache = str(tmp_path / "shared")
  both = features.target_features(rows, target, cache, 2, (1, 0))
  final = features.target_features(rows, target, cache, 2)
  first = features.target_features(rows, target, cache, 2, (1,))
  assert len(list((tmp_path / "shared").iterdir())) == 1  # no second pass of the target
  assert final.shape == (5, 16, d) and first.shape == (5, 16, 2 * d)
  assert np.array_equal(final, both[..., :d]) and np.array_equal(first, both[..., : 2 * d])
  np.testing.assert_allclose(  # what a file of its own holds
    final, features.target_features(rows, target, str(tmp_path / "own"), 2), rtol=1e-6, atol=1e-6
  )
  # Layers that do not start the stored list get a file of their own.
  other = features.target_features(rows, target, cache, 2, (0,))
  assert other.shape == (5, 16, 2 * d) and len(list((tmp_path / "shared").iterdir())) == 2
  np.testing.assert_allclose(other[..., d:], both[..., 2 * d :], rtol=1e-6, atol=1e-6)
