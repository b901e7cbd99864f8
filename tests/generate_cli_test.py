"""`python -m infer.generate` as a user runs it: JSON output, prompt files, and bad input."""

import json
import re
import subprocess
import sys

import pytest

from pspec_jax import checkpoints, testing
from pspec_jax import prompts as prompts_lib


def run_cli(*flags, timeout=300, devices=1, env=None):
  return subprocess.run(
    [sys.executable, "-m", "infer.generate", *flags],
    cwd=testing.ROOT,
    env={**testing.cli_env(devices), **(env or {})},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_mt_bench_questions_are_read_first_turn():
  prompts = prompts_lib.read_prompts(prompts_lib.prompt_set_path("mt_bench"))
  assert len(prompts) == 80
  assert prompts[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--prompt="], "error: empty prompt"),
    (["--prompt=hi", "--temperature=-1"], "error: temperature must be >= 0"),
    (["--prompt=hi", "--target=no-such-model"], "error: unknown target 'no-such-model'"),
    (["--prompt=hi", "--target=./missing/checkpoint"], "error: target not found"),
    (["--prompt=hi", "--target=missing.gguf"], "error: GGUF file not found"),
    (["--prompt=hi", "--prompts=p.jsonl"], "error: give exactly one of --prompt and --prompts"),
    (["--prompt=" + "hello " * 9000], "error: prompt width"),
    (["--prompts=mt_bench", "--num_prompts=-1"], "error: --num_prompts must be >= 0"),
    (
      ["--prompt=hi", "--method=eagle", "--drafter=random", "--tree=bushy"],
      "error: unknown tree 'bushy'",
    ),
    (
      ["--prompt=hi", "--method=pspec", "--drafter=random", "--tree=chain+lookup:0"],
      "error: bad lookup '0'",
    ),
    (["--prompt=hi", "--method=pspec", "--drafter=/nonexistent"], "error: drafter not found"),
    (["--prompt=hi", "--mesh=model=2"], "error: bad mesh 'model=2'"),
    (["--prompts=tests"], "error: prompts: tests is a directory"),
    # The shipped pspec drafter's tree is explicit rank paths: K would change nothing.
    (["--prompt=hi", "--method=pspec", "--num_draft=100"], "error: --num_draft=100 would change"),
    (
      ["--prompt=hi", "--method=pspec", "--tree=adaptive", "--num_draft=100"],
      "error: --num_draft=100 would change",  # the drafter's candidates fix their own depths
    ),
    (["--prompt=hi", "--num_draft=3"], "error: --num_draft needs a drafting method"),
    (["--prompt=hi", "extra"], "error: unexpected arguments ['extra']"),
    (["--prompt=hi", "--mesh=data=2,tensor=2"], "error: mesh {'data': 2, 'fsdp': 1, 'tensor': 2}"),
  ],
)
def test_bad_input_is_one_clear_line(flags, message):
  result = run_cli(*flags)
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines == [lines[-1]] and lines[-1].startswith(message), result.stderr


def test_corrupt_checkpoint_is_one_clear_line(tmp_path):
  bad = tmp_path / "model.gguf"
  bad.write_bytes(b"\0" * 100)
  result = run_cli("--prompt=hi", f"--target={bad}")
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert result.stderr.strip().startswith("error: ")


def test_a_target_without_a_shipped_drafter_needs_one():
  # The embedded model's file under another name: no drafter ships for it.
  gguf = checkpoints.resolve_target("smollm2-135m-instruct").path
  result = run_cli("--prompt=hi", f"--target={gguf}", "--method=pspec")
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert result.stderr.strip().startswith("error: --method=pspec needs --drafter"), result.stderr


DRAFT_FLAGS = ["--batch_size=2", "--max_new_tokens=24", "--json"]


def _json_lines(result):
  assert result.returncode == 0, result.stderr
  return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
  """Plain greedy decoding of a prompt file (with a blank line), shared by every drafting
  method and the sharded run."""
  prompts = tmp_path_factory.mktemp("drafting") / "prompts.jsonl"
  lines = ["What is 2 + 2?", "Repeat the word apple ten times."]
  prompts.write_text(json.dumps({"prompt": lines[0]}) + "\n\n" + json.dumps({"prompt": lines[1]}))
  return prompts, _json_lines(run_cli(f"--prompts={prompts}", *DRAFT_FLAGS, "--method=none"))


def test_json_output_for_a_prompt_file(plain_run):
  _, records = plain_run
  assert [r["prompt"] for r in records] == ["What is 2 + 2?", "Repeat the word apple ten times."]
  for r in records:
    assert {"prompt", "text", "tokens", "num_tokens", "seconds", "rounds", "tau"} <= set(r)
    # `seconds` is decoding alone; tracing and compiling (or reading the compiled program
    # from the cache) is reported apart, by the batch that paid for it.
    assert r["seconds"] > 0 and r["compile_seconds"] > 0
    assert 1 <= r["num_tokens"] == len(r["tokens"]) <= 24 and r["text"].strip()
    # What produced the answers, for `infer.agreement` to check.
    assert (r["target"], r["chat"], r["temperature"]) == ("smollm2-135m-instruct", True, 0.0)
  assert "4" in records[0]["text"]


def test_without_json_a_run_ends_with_one_summary_line():
  result = run_cli("--prompt=Count from 1 to 10.", "--max_new_tokens=12", "--method=pld")
  assert result.returncode == 0, result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert re.fullmatch(
    r"12 tokens in [0-9.]+ s \([0-9.]+ tokens/s; compiling [0-9.]+ s more\), "
    r"tau [0-9.]+ tokens per target pass, method pld, tree lookup",
    last,
  ), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
  ("method", "tree"), [("pld", ""), ("pspec", ""), ("eagle", "fixed"), ("medusa", "fixed")]
)
def test_drafting_through_the_cli_is_lossless(plain_run, drafting_pays, method, tree):
  """Drafts accepted (tau > 1) and the tokens of plain greedy decoding, prompt for prompt;
  pspec, eagle and medusa use the drafters shipped for the embedded target: pspec its default
  tree on a CPU (adaptive: its round costs read from a calibration where drafting pays; real
  calibrations are `calibration_test`'s), eagle and medusa their fixed ones (`--tree=fixed`)."""
  prompts, plain_lines = plain_run
  flags = [f"--method={method}"] + ([f"--tree={tree}"] if tree else [])
  env = drafting_pays(batch=2) if method == "pspec" else None
  result = run_cli(f"--prompts={prompts}", *DRAFT_FLAGS, *flags, env=env)
  assert "calibrating" not in result.stderr  # pspec's costs were read from the file
  drafted = _json_lines(result)
  for spec, plain in zip(drafted, plain_lines, strict=True):
    assert spec["prompt"] == plain["prompt"]
    assert spec["tokens"] == plain["tokens"] and spec["num_tokens"] <= 24
    assert plain["tau"] == 1 and plain["rounds"] == plain["num_tokens"] - 1
    assert spec["tau"] >= 1 and 1 <= spec["rounds"] <= plain["rounds"]
    assert spec["tau"] * spec["rounds"] == pytest.approx(spec["num_tokens"] - 1, abs=0.01)
  assert any(r["tau"] > 1 for r in drafted)


def test_sharded_decoding_through_the_cli_gives_the_same_tokens(plain_run):
  """The embedded target and its pspec drafter over a tensor=2 mesh of two (fake) devices: MLP
  and vocabulary split, and still plain decoding's tokens over the same mesh. (Plain decoding
  without a mesh is not the reference: there the CPU kernel multiplies the GGUF file's blocks
  with x quantised to 8 bits, while a mesh decodes the dequantised weights, and near-ties may
  fall the other way.)"""
  prompts, _ = plain_run
  sharded = {
    method: _json_lines(
      run_cli(
        f"--prompts={prompts}",
        *DRAFT_FLAGS,
        f"--method={method}",
        *(["--tree=fixed"] if method == "pspec" else []),
        "--mesh=tensor=2",
        devices=2,
      )
    )
    for method in ("none", "pspec")
  }
  assert [r["tokens"] for r in sharded["pspec"]] == [r["tokens"] for r in sharded["none"]]
  assert all(r["tau"] == 1 for r in sharded["none"])
  assert any(r["tau"] > 1 for r in sharded["pspec"])
