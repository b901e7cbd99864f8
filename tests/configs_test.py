"""Every real training config, from shapes alone: sizes, shardings and the memory plan."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from pspec_jax import drafter as drafter_lib
from pspec_jax import llama, presets, sharding, testing
from train import build, plan
from train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (target parameters, pspec drafter parameters), in billions. Targets: the published
# sizes; drafters: one decoder layer plus the 2D -> D fuse, EAGLE's published 0.24B / 0.37B.
REAL = {
  "llama2_7b": (6.738, 0.236),
  "llama2_13b": (13.016, 0.370),
  "vicuna_7b": (6.738, 0.236),
  "vicuna_13b": (13.016, 0.370),
  "llama3_8b": (8.030, 0.252),
  "smollm2_135m": (0.1345, 0.00421),
}


def _load(name, variant=""):
  module = __import__(f"configs.{name}", fromlist=["get_config"])
  return module.get_config(variant or None)


def _count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", sorted(REAL))
def test_parameter_counts_match_the_published_sizes(name):
  config = _load(name)
  cfg = build.step_config(config)
  key = jax.random.key(0)
  target = jax.eval_shape(lambda: llama.init_params(cfg.target, key))
  drafter = jax.eval_shape(lambda: drafter_lib.init_params(cfg.drafter, key))
  want_target, want_drafter = REAL[name]
  assert _count(target) / 1e9 == pytest.approx(want_target, abs=0.001 * max(want_target, 1))
  assert _count(drafter) / 1e9 == pytest.approx(want_drafter, rel=0.01)


@pytest.mark.parametrize("name", ["llama2_13b", "llama3_8b"])
@pytest.mark.parametrize("hardware", ["v4-32", "v5e-16"])
def test_shardings_on_the_intended_mesh_split_every_large_array(name, hardware):
  config = _load(name, hardware)
  cfg = build.step_config(config)
  mesh = plan.abstract_mesh(config)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 16, "tensor": 1}
  place = step_lib.placement(cfg, mesh)
  key = jax.random.key(0)
  target = jax.eval_shape(lambda: llama.init_params(cfg.target, key))
  for x, placed in zip(jax.tree.leaves(target), jax.tree.leaves(place.target), strict=True):
    shard = placed.shard_shape(x.shape)  # raises if the spec does not divide the shape
    if x.size > 1e6:
      assert np.prod(shard) * 16 == x.size, (x.shape, placed.spec)
  params = jax.eval_shape(lambda: drafter_lib.init_params(cfg.drafter, key))
  for x, placed in zip(jax.tree.leaves(params), jax.tree.leaves(place.state.params), strict=True):
    placed.shard_shape(x.shape)
  assert place.batch["tokens"].spec == PartitionSpec(("data", "fsdp"), None)


@pytest.mark.parametrize("variant", ["v4-32", "v4-8", "v5e-16", "gpu-80gb"])
def test_dry_run_prints_the_memory_plan_without_allocating(variant):
  command = [
    sys.executable,
    "-m",
    "train.distill",
    f"--config=configs/llama2_13b.py:{variant}",
    "--dry_run",
  ]
  env = testing.cli_env()
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  assert "13.016B parameters" in out
  devices, memory = presets.HARDWARE[variant]
  assert f"{devices} devices, {memory:g} GiB each" in out
  for row in ("target params", "drafter params", "optimizer state", "total"):
    assert row in out
  target_gib = float(next(line for line in out.splitlines() if "target params" in line).split()[-1])
  assert target_gib == pytest.approx(13.016e9 * 2 / devices / 2**30, rel=0.01)  # bf16
  # Each preset splits the batch into as many microbatches as it needs to fit.
  assert "does NOT fit" not in out
  assert next(line for line in out.splitlines() if line.startswith("total")).endswith(
    f"fits in {memory:g} GiB"
  )
  # A CPU is not the plan's hardware: the program is not compiled for it.
  platform = "gpu" if variant.startswith("gpu") else "tpu"
  assert out.strip().splitlines()[-1] == (
    f"compiled memory analysis: not run here (1 cpu device(s), the plan is for {devices} "
    f"{platform}); run --dry_run on that hardware"
  )


def _tiny_sharded_config(cached_features: bool):
  config = _load("smollm2_135m", "smoke")
  config.target.arch.update(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4)
  config.target.arch.update(num_kv_heads=2, vocab_size=512)
  config.drafter.draft_vocab_size = 256
  config.hardware.update(devices=8, memory_gib=0.05)
  config.train.batch_size = 8
  config.mesh.update(data=2, fsdp=2, tensor=2)
  config.data.cache_features = cached_features
  return config


def test_dry_run_on_the_plans_hardware_compiles_the_sharded_step():
  """On a host with the configured devices (here the 8 fake ones), the dry run compiles the
  train step for the mesh and adds XLA's per-device memory analysis to the plan."""
  config = _tiny_sharded_config(cached_features=False)
  cfg = build.step_config(config)
  lines = plan.compiled_memory(config, cfg).splitlines()
  assert lines[0] == "compiled train step on 8 cpu device(s), per device"
  rows = {line[:34].strip(): line[34:].split() for line in lines[1:]}
  assert list(rows) == [
    "arrays held (params, state, batch)",
    "outputs not aliasing arguments",
    "temporaries",
    "total",
  ]
  assert rows["total"][1:] == ["fits", "in", "0.05", "GiB"]

  mesh = sharding.make_mesh(**config.mesh.to_dict())
  plain = plan.compiled_bytes(config, cfg, mesh)
  assert plain["arrays held (params, state, batch)"] == sum(
    plan.held_bytes(config, cfg, plan.abstract_mesh(config)).values()
  )
  assert plain["outputs not aliasing arguments"] < 1024  # the state is donated: metrics only
  config = _tiny_sharded_config(cached_features=True)
  cached = plan.compiled_bytes(config, build.step_config(config), mesh)
  # Features in the batch: no target forward pass, a larger batch.
  assert 0 < cached["temporaries"] < plain["temporaries"]
  assert cached["arrays held (params, state, batch)"] > plain["arrays held (params, state, batch)"]


@pytest.mark.parametrize(
  ("args", "message"),
  [
    (["--config=configs/smollm2_135m.py", "--config.train.nope=1"], "unknown config key 'nope'"),
    (["--config=configs/llama2_13b.py:nope", "--dry_run"], "unknown config variant 'nope'"),
    (["--config=configs/no_such.py"], "No such file"),
    (
      ["--config=configs/llama2_13b.py", "--workdir=/tmp/unused"],
      "target not found: /data/Llama-2-13b-chat-hf",
    ),
  ],
)
def test_bad_configs_are_one_clear_error(args, message):
  env = testing.cli_env()
  result = subprocess.run(
    [sys.executable, "-m", "train.distill", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  assert result.returncode == 1
  assert message in result.stderr and "Traceback" not in result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith("error: ")
