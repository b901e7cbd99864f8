"""`train.throughput`: a config's train step timed with every mask slot and with COD."""

import os
import re
import subprocess
import sys

import pytest

from pspec_jax import testing
from train import throughput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_keep_pairs_are_parsed_and_a_bad_one_is_one_error():
  assert throughput.parse_keep(["1/0", "0.7/0.2"]) == [(1.0, 0.0), (0.7, 0.2)]
  with pytest.raises(ValueError, match="--keep: '0.7' is not ratio/floor"):
    throughput.parse_keep(["0.7"])


def test_every_variant_is_timed_and_cod_trains_fewer_slot_rows():
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "train.throughput",
      f"--config={testing.SMOKE}",
      "--config.drafter.num_draft=6",
      "--keep=1/0,0.5/0.1",
      "--repeats=1",
    ],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert lines[0].startswith("pspec K=6, batch 2 x 64, 8 anchors"), lines
  rows = [re.match(r"keep (\S+): +(\d+) slot rows/step, step +([\d.]+) ms", x) for x in lines[1:]]
  assert [m.group(1) for m in rows] == ["1/0", "0.5/0.1"], lines
  full, cod = (int(m.group(2)) for m in rows)
  # Every slot of 8 anchors x 2 rows: 5 slots x 16; COD keeps ceil(8 max(0.5^d, 0.1)) of them.
  assert full == 5 * 16 and cod == 2 * (4 + 2 + 1 + 1 + 1)
  assert all(float(m.group(3)) > 0 for m in rows)
