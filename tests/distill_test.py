"""`train.distill` end to end on the smoke config, with a SIGKILL."""

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util

from pspec_jax import drafter_files, testing

pytestmark = pytest.mark.slow


def _command(module, workdir, cache, *extra):
  return [
    sys.executable,
    "-m",
    module,
    f"--config={testing.SMOKE}",
    f"--workdir={workdir}",
    f"--config.data.cache_dir={cache}",
    *extra,
  ]


def _train_lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as fh:
    return [r for r in map(json.loads, fh) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One smoke run from start to finish: (workdir, data cache)."""
  base = tmp_path_factory.mktemp("distill")
  workdir, cache = base / "run", base / "cache"
  result = subprocess.run(
    _command("train.distill", workdir, cache),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, cache


def test_smoke_run_logs_checkpoints_and_exports(uninterrupted, smollm2):
  workdir, _ = uninterrupted
  lines = _train_lines(workdir)
  assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
  for r in lines:
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "agree_per_depth/d4"} <= set(r)
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert any("eval/loss" in r for r in records)
  assert os.listdir(workdir / "tb"), "no TensorBoard event file"
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]  # keep_checkpoints=2
  target, _ = smollm2
  drafter = drafter_files.load_drafter(str(workdir / "export"), target)
  assert drafter.cfg.kind == "pspec" and drafter.cfg.num_draft == 4


def test_eval_only_scores_the_last_checkpoint(uninterrupted, tmp_path):
  workdir, cache = uninterrupted
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  result = subprocess.run(
    _command("train.distill", copy, cache, "--eval_only"),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  # The coverage reported is that of the vocabulary the checkpoint drafts over.
  assert "draft vocabulary: the checkpoint's 16384 tokens cover " in result.stdout
  (line,) = [x for x in result.stdout.splitlines() if x.startswith("held-out at step 6: ")]
  scores = json.loads(line.split(": ", 1)[1])
  assert set(scores) >= {"loss", "agree_per_depth/d1", "agree_per_depth/d4"}
  last = json.loads((copy / "metrics.jsonl").read_text().splitlines()[-1])
  assert last["step"] == 6 and last["eval/loss"] == pytest.approx(scores["loss"])
  assert _train_lines(copy) == _train_lines(workdir)  # nothing trained


def test_a_run_killed_in_the_middle_of_a_save_resumes_where_it_stopped(uninterrupted, tmp_path):
  """SIGKILL while the asynchronous save of step 4 is being written: the restart resumes from
  step 2, the last complete checkpoint, and ends where the uninterrupted run did."""
  reference, cache = uninterrupted
  workdir = tmp_path / "run"
  proc = subprocess.Popen(
    _command("train.distill", workdir, cache),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  checkpoints = workdir / "checkpoints"
  deadline = time.time() + 600
  in_flight = []
  while time.time() < deadline and proc.poll() is None and not in_flight:
    names = os.listdir(checkpoints) if checkpoints.exists() else []
    # orbax writes a step under `<step>.orbax-checkpoint-tmp...` and renames it when complete
    in_flight = [n for n in names if n.startswith("4.") and "tmp" in n]
    time.sleep(0.002)
  assert proc.poll() is None, "the run ended before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert in_flight, "no save of step 4 was seen in progress"
  complete = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit())
  assert complete and complete[-1] == 2, complete
  result = subprocess.run(
    _command("train.distill", workdir, cache),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resumed from step 2 (data position 4)" in result.stdout
  assert "skipped" not in result.stdout
  # Same steps, same data, same updates: the resumed run ends exactly where the other did.
  resumed = {r["step"]: r for r in _train_lines(workdir)}
  for r in _train_lines(reference):
    if r["step"] > 2:
      assert resumed[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-5)
  assert sorted(os.listdir(checkpoints)) == ["4", "6"]


def _damage(checkpoint, how):
  if how == "truncated":  # the largest array file of the state, cut to a few bytes
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:100])
  else:  # the JSON metadata item, emptied
    (checkpoint / "meta" / "metadata").write_text("")


@pytest.mark.parametrize("how", ["truncated", "emptied_metadata"])
def test_resume_falls_back_past_a_damaged_checkpoint(uninterrupted, tmp_path, how):
  """The newest checkpoint (step 6) damaged: the restart says so, resumes from step 4, and
  trains steps 5 and 6 again exactly as the uninterrupted run did."""
  reference, cache = uninterrupted
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  _damage(workdir / "checkpoints" / "6", how)
  result = subprocess.run(
    _command("train.distill", workdir, cache),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  (skipped,) = [x for x in result.stdout.splitlines() if x.startswith("skipped")]
  reason = "does not read back" if how == "truncated" else "not valid JSON"
  assert skipped.startswith("skipped the damaged checkpoint at step 6: ") and reason in skipped
  assert "resumed from step 4 (data position 8)" in result.stdout
  assert "Traceback" not in result.stderr, result.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]
  assert os.listdir(workdir / "checkpoints_damaged") == ["6"]  # kept for a look, out of the way
  lines = _train_lines(workdir)
  again = [r for r in lines if r["step"] > 4][-2:]
  assert [r["step"] for r in again] == [5, 6]
  want = {r["step"]: r["loss"] for r in _train_lines(reference)}
  for r in again:
    assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-5)


def test_a_run_started_from_a_drafter_file_keeps_it_until_it_trains(
  uninterrupted, smollm2, tmp_path
):
  """`train.init_from`: a fresh workdir starts from the drafter file's weights and vocabulary;
  restarted, it resumes its own checkpoint instead."""
  reference, cache = uninterrupted
  target, _ = smollm2
  # The smoke run's drafter, drafting over its vocabulary in reverse order: not what a run
  # would choose from the data itself.
  exported = drafter_files.load_drafter(str(reference / "export"), target)
  first = dataclasses.replace(exported, vocab=exported.vocab[::-1], head=None)
  start = tmp_path / "start"
  drafter_files.save_drafter(str(start), first, dtype=ml_dtypes.bfloat16)
  # Decoding on any kind of device would take its first 1,024 tokens; training takes the file
  # as stored.
  config = json.loads((start / drafter_files.CONFIG_FILE).read_text())
  config["device_trees"] = {p: {"draft_vocab_size": 1024} for p in ("cpu", "gpu", "tpu")}
  (start / drafter_files.CONFIG_FILE).write_text(json.dumps(config))
  workdir = tmp_path / "run"

  def run(*extra):
    result = subprocess.run(
      _command("train.distill", workdir, cache, f"--config.train.init_from={start}", *extra),
      cwd=testing.ROOT,
      env=testing.cli_env(),
      capture_output=True,
      text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout

  # Scored before any training, and trained at learning rate 0, it is the drafter it started
  # from: the same held-out scores, the same exported weights.
  (before,) = [x for x in run("--eval_only").splitlines() if x.startswith("held-out at step 0: ")]
  out = run("--config.train.lr=0", "--config.train.steps=2")
  assert f"starting from the drafter in {start}" in out
  assert "draft vocabulary: the starting drafter's 16384 tokens" in out
  after = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
  assert after["step"] == 2
  assert after["eval/loss"] == pytest.approx(json.loads(before.split(": ", 1)[1])["loss"])
  want = traverse_util.flatten_dict(first.params, sep="/")
  got = drafter_files.load_drafter(str(workdir / "export"), target)
  np.testing.assert_array_equal(got.vocab, first.vocab)
  assert traverse_util.flatten_dict(got.params, sep="/").keys() == want.keys()
  for name, value in traverse_util.flatten_dict(got.params, sep="/").items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)
  # Restarted with a longer schedule, it resumes at step 2 and trains on from there; the
  # starting drafter is not needed any more.
  shutil.rmtree(start)
  out = run("--config.train.steps=3")
  assert "resumed from step 2" in out and "starting from" not in out
  trained = drafter_files.load_drafter(str(workdir / "export"), target)
  changed = traverse_util.flatten_dict(trained.params, sep="/")
  assert any(not np.array_equal(changed[name], want[name]) for name in want)


def test_a_diverged_run_keeps_only_finite_weights_and_a_sane_restart_finishes(
  uninterrupted, smollm2, tmp_path
):
  """An absurd learning rate blows the drafter up within a few steps. The step that gives a
  non-finite loss, gradient or update is never kept, nor the checkpoint whose weights gave it;
  the error says which checkpoint a restart resumes from, and a restart with a sane rate
  resumes from it and finishes with finite weights."""
  _, cache = uninterrupted
  workdir = tmp_path / "run"
  huge = ("--config.train.lr=1e30", "--config.train.clip_norm=1e30")
  result = subprocess.run(
    _command("train.distill", workdir, cache, *huge),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode != 0 and "Traceback" not in result.stderr
  # The error is a line of its own, not appended to the progress bar's.
  (error,) = [x for x in result.stderr.splitlines() if "error:" in x]
  assert error.startswith("error: step ") and "non-finite" in error
  said = int(error.split("the last checkpoint (step ")[1].split(")")[0])
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints"))[-1] == said
  result = subprocess.run(
    _command("train.distill", workdir, cache),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"resumed from step {said} " in result.stdout
  drafter = drafter_files.load_drafter(str(workdir / "export"), smollm2[0])
  for name, value in traverse_util.flatten_dict(drafter.params, sep="/").items():
    assert np.isfinite(np.asarray(value, np.float32)).all(), name
  assert [r["step"] for r in _train_lines(workdir)][-1] == 6


def test_hyper_parameters_are_checked_before_anything_loads():
  from configs import smollm2_135m
  from train import build

  for key, value in [("lr", float("nan")), ("lr", -1.0), ("clip_norm", 0.0), ("steps", 0)]:
    config = smollm2_135m.get_config("smoke")
    config.train[key] = value
    with pytest.raises(ValueError, match=f"train.{key}="):
      build.step_config(config)
  config = smollm2_135m.get_config("smoke")
  config.data.seq_len = 0  # before: "no conversation has assistant tokens within ..."
  with pytest.raises(ValueError, match="data.seq_len=0: it must be >= 2"):
    build.step_config(config)


def test_a_workdir_that_is_a_file_is_one_error_line(tmp_path):
  path = tmp_path / "file"
  path.write_text("")
  result = subprocess.run(
    _command("train.distill", path, tmp_path / "cache", "--config.train.steps=1"),
    cwd=testing.ROOT,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
  )
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
    f"error: --workdir: {path} is a file, not a directory: give a directory"
  )


def test_workdir_urls_are_kept_and_local_paths_made_absolute(tmp_path, monkeypatch):
  from train import distill

  monkeypatch.chdir(tmp_path)
  assert (
    str(distill.workdir_path("gs://bucket/run") / "checkpoints") == "gs://bucket/run/checkpoints"
  )
  assert str(distill.workdir_path("runs/a")) == str(tmp_path / "runs" / "a")


def test_two_processes_train_as_one(uninterrupted, smollm2, tmp_path):
  """Two CPU processes (one device each) under jax.distributed: each feeds its half of the
  global batch; the losses are the single-process run's, and process 0 alone logs and exports
  while both write the checkpoints."""
  reference, cache = uninterrupted
  workdir = tmp_path / "run"
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [
    subprocess.Popen(
      _command(
        "train.distill",
        workdir,
        cache,
        "--config.distributed=True",
        f"--config.cluster.coordinator_address=127.0.0.1:{port}",
        "--config.cluster.num_processes=2",
        f"--config.cluster.process_id={i}",
        "--config.data.cache_features=False",
        "--config.train.steps=4",
      ),
      cwd=testing.ROOT,
      env=testing.cli_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outputs, strict=True):
    assert p.returncode == 0, err[-3000:]
  lines = _train_lines(workdir)
  assert [r["step"] for r in lines] == [1, 2, 3, 4]  # one writer: no step twice
  # The same data and, through the warmup (2 steps), the same learning rates as that run.
  single = {r["step"]: r for r in _train_lines(reference)}
  for step in (1, 2):
    assert lines[step - 1]["loss"] == pytest.approx(single[step]["loss"], rel=1e-4)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
  drafter = drafter_files.load_drafter(str(workdir / "export"), smollm2[0])
  assert drafter.cfg.kind == "pspec"
  assert (
    "resumed" not in outputs[1][0] and "distill pspec" not in outputs[1][1]
  )  # process 1: no bar
