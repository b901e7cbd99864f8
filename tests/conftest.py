"""Tests run on the CPU with 8 fake devices, so sharding code is exercised everywhere."""

import dataclasses
import os
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling is most of the suite's time and most programs here run on tiny inputs, so XLA
# compiles for less: its LLVM backend optimises less (-O0 instead of -O3; the suite took 10
# minutes instead of 13 on two cores), and fusions are emitted by XLA:CPU's older LLVM IR
# emitters instead of its MLIR fusion emitters (a decoding program then compiles in 25-40% less
# time; measured over a sample of this suite's tests, 76 s instead of 101). Kernels then round
# differently (the embedded target's logits on a prompt moved by up to 1e-4, their argmax not at
# all): comparisons with references keep float tolerances, and a lossless check compiles both
# sides alike. The programs tests start (`infer.generate`, `train.distill`, ...) get XLA's
# default flags: they run the real model, and there what compiles faster runs slower (with
# these flags for them too the whole suite took 23:53 on two cores, and 23:27 without them on
# the same machine: no gain).
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  + " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the session's workers and the programs they start: the
# CLI tests compile the same real-model programs again and again.
_SUITE_CACHE = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_SUITE_CACHE, "jax"))
# The suite's own `pspec_jax.cache_dir` (the CPU kernel's build, round-cost calibrations,
# tokenizers), never the user's: rounds timed while both cores run tests are not this machine's
# costs, and stored in the user's cache they would steer the next `make bench` (a run after
# `make test` read a root-alone round of 13.6 ms there, against 6.6 ms on a quiet machine).
os.environ["PSPEC_JAX_CACHE"] = os.path.join(_SUITE_CACHE, "pspec_jax")

import jax  # noqa: E402
import pytest  # noqa: E402

import pspec_jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def smollm2():
  """The embedded default target (float32) and its tokenizer, loaded once per session."""
  from pspec_jax import checkpoints

  return (
    checkpoints.load_target("smollm2-135m-instruct"),
    checkpoints.load_tokenizer("smollm2-135m-instruct"),
  )


def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except OSError:
    return 0  # not Linux: no such limit to keep under


def _memory_mappings() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


_MAPPINGS_BUDGET = _max_map_count() // 2


def pytest_collection_modifyitems(items):
  """Files that hold a slow test (`slow`: tens of seconds or more) come first. With the
  Makefile's `--dist loadfile --no-loadscope-reorder` each worker then takes whole files in this
  order, so the workers begin with the long files and end together on the many short ones,
  instead of one of them running a long file alone at the end (xdist's default order puts the
  files with the most tests first, and those are the short ones here)."""
  slow = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow)  # stable: files and tests keep their order


@pytest.fixture
def drafting_pays(tmp_path):
  """`drafting_pays(batch)`: the environment of a program a test starts (`testing.cli_env`'s
  additions) whose cache holds a calibration in which every candidate of the embedded target's
  shipped pspec drafter's adaptive tree (its CPU default) costs a plain round, greedy, at
  `batch`: its rounds draft whatever the machine's load. Calibrated while the suite shares the
  cores, drafted rounds measured 1.6-3.6 plain ones there, a decode rightly chose the root
  alone throughout, and the calibration took minutes (the real one is `calibration_test`'s).
  The CPU kernel's build and the tokenizers are the suite's own."""
  from infer import calibration
  from pspec_jax import checkpoints, decode, drafter_files

  # The keys read configs alone (loading the weights took half a minute under load).
  name = "smollm2-135m-instruct"
  layout = checkpoints.decode_layout()
  target = types.SimpleNamespace(
    cfg=dataclasses.replace(checkpoints.load_target_config(name), weight_layout=layout)
  )
  shipped = drafter_files.shipped_drafter(name, "pspec")
  drafter = types.SimpleNamespace(cfg=drafter_files.read_drafter_config(shipped, target.cfg))
  pool = decode.resolve_tree(decode.DecodeConfig(), drafter)
  assert pool.candidates, "the shipped pspec drafter decodes with an adaptive tree on a CPU"
  entries = {calibration.candidate_key(drafter, c): dict(costs=[1.0, 1.0]) for c in pool.candidates}
  root = tmp_path / "pspec_jax_cache"

  def env(batch: int) -> dict:
    calibration.save(
      str(root / "calibration" / calibration.FILE),
      {calibration.machine_key(target, batch): entries},
    )
    for shared in ("kernels", "tokenizers"):
      os.makedirs(pspec_jax.cache_dir(shared), exist_ok=True)
      if not (root / shared).exists():
        os.symlink(pspec_jax.cache_dir(shared), root / shared)
    return dict(PSPEC_JAX_CACHE=str(root))

  return env


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """A compiled program holds hundreds of memory mappings (its JIT-linked kernels) for as long
  as jax keeps it. A worker that kept every program its tests compiled reached the kernel's
  limit (vm.max_map_count, 65,530; one test file alone came to 49k) and XLA aborted mid-compile.
  So once a worker holds half of that, its compiled programs are dropped."""
  yield
  if _MAPPINGS_BUDGET and _memory_mappings() > _MAPPINGS_BUDGET:
    jax.clear_caches()
