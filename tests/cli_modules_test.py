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
  "train.distill": "--[no]eval_only",
  "train.selfdistill": "--config",
}


def test_cli_modules_import_together():
  for name in CLI_MODULES:
    importlib.import_module(name)


@pytest.mark.parametrize("name", CLI_MODULES)
def test_cli_help_lists_its_flags(name):
  out = subprocess.run(
    [sys.executable, "-m", name, "--helpshort"],
    capture_output=True,
    text=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    check=False,
  )
  assert out.returncode == 1, out.stderr  # absl's help exits 1
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
