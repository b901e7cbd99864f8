"""`train.selfdistill` end to end on the smoke config: shards, resumed after a loss."""

import json
import os
import subprocess
import sys

import pytest
from distill_test import ROOT, SMOKE, cli_env

pytestmark = pytest.mark.slow


def test_selfdistill_writes_resumable_shards(tmp_path, smollm2):
  out = tmp_path / "sd"
  command = [
    sys.executable,
    "-m",
    "train.selfdistill",
    f"--config={SMOKE}",
    f"--config.selfdistill.out={out}",
  ]
  result = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-3000:]
  shards = sorted(os.listdir(out))
  assert shards == ["part-00000.jsonl", "part-00001.jsonl"]
  records = [json.loads(line) for s in shards for line in (out / s).read_text().splitlines()]
  assert len(records) == 4
  for r in records:
    turns = r["conversations"]
    assert turns[-2]["from"] == "user" and turns[-1]["from"] == "gpt" and turns[-1]["value"]
  # Batches are formed by prompt length (shard 0's two prompts swap places), yet every record
  # holds its own prompt's greedy answer.
  prompts = [_prompt_ids(smollm2[1], r) for r in records]
  assert len(prompts[0]) > len(prompts[1])
  answers = [r["conversations"][-1]["value"] for r in records]
  assert answers[0] != answers[1]
  assert answers == _greedy_answers(smollm2, prompts[:2]) + _greedy_answers(smollm2, prompts[2:])
  # A missing shard, and one shorter than the config asks for (as after raising
  # num_conversations), are answered again; greedy, so with the same answers.
  written = [(out / name).read_text() for name in shards]
  (out / shards[0]).unlink()
  (out / shards[1]).write_text(written[1].splitlines(keepends=True)[0])
  result = subprocess.run(command, cwd=ROOT, env=cli_env(), capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-3000:]
  assert [(out / name).read_text() for name in shards] == written


def _prompt_ids(tokenizer, record):
  turns = [{"role": t["from"], "content": t["value"]} for t in record["conversations"][:-1]]
  text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
  return tokenizer(text, add_special_tokens=False).input_ids


def _greedy_answers(smollm2, prompts, max_new_tokens=8):
  """The target's greedy answers to `prompts`, decoded in one batch (as one shard is)."""
  import jax

  from pspec_jax import checkpoints, decode
  from pspec_jax import prompts as prompts_lib

  target, tokenizer = smollm2
  cfg = decode.DecodeConfig(
    max_new_tokens=max_new_tokens,
    eos_ids=checkpoints.eos_token_ids("smollm2-135m-instruct", tokenizer),
    pad_id=tokenizer.pad_token_id or 0,
  )
  out = decode.generate(target, *prompts_lib.pad_batch(prompts), jax.random.key(0), cfg)
  return [
    tokenizer.decode(out.tokens[row, : out.lengths[row]].tolist(), skip_special_tokens=True)
    for row in range(len(prompts))
  ]
