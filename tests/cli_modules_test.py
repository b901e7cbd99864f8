"""The command-line modules import into one process and each still parses its own flags."""

import importlib
import os
import subprocess
import sys

import pytest

CLI_MODULES = {  # module: one flag only it defines
  "infer.generate": "--[no]json",
  "infer.bench": "--[no]dry_run",
  "infer.profile_round": "--repeats",
  "infer.tune_tree": "--pool",
  "infer.agreement": "--answers",
  "train.distill": "--[no]eval_only",
  "train.selfdistill": "--config",
}


def test_cli_modules_import_together():
  for name in CLI_MODULES:
    importlib.import_module(name)


@pytest.mark.parametrize("name", CLI_MODULES)
def test_cli_help_lists_its_flags(name):
  help_flag = "--help" if name == "infer.generate" else "--helpshort"
  out = subprocess.run(
    [sys.executable, "-m", name, help_flag],
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    check=False,
  )
  assert out.returncode == 0, out.stderr  # help asked for is no error (absl's exits 1)
  assert CLI_MODULES[name] in out.stdout


@pytest.mark.parametrize(
  "name,args",
  [
    ("infer.bench", ["--config.nope=1"]),  # its config file is loaded as the flag is defined
    ("train.distill", ["--config=configs/smollm2_135m.py", "--config.train.nope=1"]),
  ],
)
def test_an_unknown_config_key_is_one_clear_line(name, args):
  out = subprocess.run(
    [sys.executable, "-m", name, *args],
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    check=False,
  )
  assert out.returncode == 1
  assert out.stderr.strip() == "error: unknown config key 'nope'", out.stderr


def _cpu_env(**changes):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  return dict(env, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **changes)


def test_a_program_keeps_what_it_compiled_for_the_next_run(tmp_path):
  # Every program runs its main through `cli.run`, as this one does.
  program = (
    "import jax; from pspec_jax import cli; "
    "cli.run(lambda: jax.jit(lambda x: x + 1)(1.0), lambda: None)"
  )
  out = subprocess.run(
    [sys.executable, "-c", program],
    capture_output=True,
    text=True,
    env=_cpu_env(PSPEC_JAX_CACHE=str(tmp_path)),
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert any(name.startswith("jit__lambda") for name in os.listdir(tmp_path / "xla"))


def test_a_compilation_cache_the_user_set_is_used_as_it_is(tmp_path):
  program = "from pspec_jax import cli; cli.keep_compiled_programs(); import jax; jax.jit(abs)(1.0)"
  env = _cpu_env(PSPEC_JAX_CACHE=str(tmp_path / "ours"), JAX_COMPILATION_CACHE_DIR=str(tmp_path))
  subprocess.run([sys.executable, "-c", program], env=env, check=True)
  assert any(name.endswith("-cache") for name in os.listdir(tmp_path))
  assert not (tmp_path / "ours").exists()


def test_decoding_programs_multiply_float32_in_float32():
  import jax

  from pspec_jax import cli

  with jax.default_matmul_precision(None), cli.full_float32_matmuls():
    assert jax.config.jax_default_matmul_precision == "highest"
  # A precision the user chose (JAX_DEFAULT_MATMUL_PRECISION sets the same) wins.
  with jax.default_matmul_precision("tensorfloat32"), cli.full_float32_matmuls():
    assert jax.config.jax_default_matmul_precision == "tensorfloat32"
