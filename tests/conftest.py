"""Tests run on the CPU with 8 fake devices, so sharding code is exercised everywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compilation cache for the session's workers and the programs they start: the
# CLI tests compile the same real-model programs again and again.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax"),
)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def smollm2():
  """The embedded default target (float32) and its tokenizer, loaded once per session."""
  from pspec_jax import checkpoints

  return (
    checkpoints.load_target("smollm2-135m-instruct"),
    checkpoints.load_tokenizer("smollm2-135m-instruct"),
  )
