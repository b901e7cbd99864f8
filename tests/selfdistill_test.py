"""`train.selfdistill` end to end on the smoke config: shards, resumed after a loss, and the
same dataset from two processes (jax.distributed on CPU) as from one."""

import json
import os
import socket
import subprocess
import sys

import pytest

from pspec_jax import testing

pytestmark = pytest.mark.slow


def test_selfdistill_writes_resumable_shards(single, tmp_path, smollm2):
  # The greedy dataset of one process (the `single` fixture's run), resumed here.
  out = tmp_path / "sd"
  out.mkdir()
  for name, data in single(0.0).items():
    (out / name).write_bytes(data)
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
  _run_processes(out, 1)
  assert [(out / name).read_text() for name in shards] == written


def _command(out, *extra):
  return [
    sys.executable,
    "-m",
    "train.selfdistill",
    f"--config={testing.SMOKE}",
    f"--config.selfdistill.out={out}",
    *extra,
  ]


def _run_processes(out, count, *extra, devices=1):
  """Runs `count` processes under jax.distributed (one plain process if count is 1), each with
  `devices` CPU devices; returns their (stdout, stderr)."""
  env = testing.cli_env(devices)
  if count == 1:
    result = subprocess.run(
      _command(out, *extra), cwd=testing.ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [(result.stdout, result.stderr)]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cluster = [
    "--config.distributed=True",
    f"--config.cluster.coordinator_address=127.0.0.1:{port}",
    f"--config.cluster.num_processes={count}",
  ]
  procs = [
    subprocess.Popen(
      _command(out, *cluster, f"--config.cluster.process_id={i}", *extra),
      cwd=testing.ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(count)
  ]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outputs, strict=True):
    assert p.returncode == 0, err[-3000:]
  return outputs


def _dataset(out):
  return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  """The dataset one process with one device writes, by temperature."""
  datasets = {}

  def get(temperature):
    if temperature not in datasets:
      out = tmp_path_factory.mktemp("single") / "sd"
      _run_processes(out, 1, f"--config.selfdistill.temperature={temperature}")
      datasets[temperature] = _dataset(out)
    return datasets[temperature]

  return get


def test_two_processes_with_two_devices_each_write_the_one_process_dataset(single, tmp_path):
  """Shard 0 from process 0, shard 1 from process 1, each batch split over two devices; at
  temperature > 0 a batch's key is its shard's and its place there, so byte for byte the
  shards one process on one device writes, whichever process draws them, and not the greedy
  answers. (Greedy, two processes write them too: `test_two_processes_resume_a_killed_run`.)"""
  out = tmp_path / "sd"
  outputs = _run_processes(out, 2, "--config.selfdistill.temperature=1.0", devices=2)
  assert _dataset(out) == single(1.0)
  assert _dataset(out) != single(0.0)
  assert list(_dataset(out)) == ["part-00000.jsonl", "part-00001.jsonl"]
  for stdout, _ in outputs:  # each answered its own shard
    assert "self-distill: 2 conversations in" in stdout
  assert "self-distill, all 2 processes: 4 conversations in" in outputs[0][0]
  assert "conversations per hour" in outputs[0][0]


def test_two_processes_resume_a_killed_run(single, tmp_path):
  """Process 1 killed while writing shard 1 (its temporary file left, the shard missing):
  the same command lines answer shard 1 alone and end with the same dataset."""
  out = tmp_path / "sd"
  out.mkdir()
  reference = single(0.0)
  (out / "part-00000.jsonl").write_bytes(reference["part-00000.jsonl"])
  (out / "part-00001.jsonl.tmp").write_bytes(reference["part-00001.jsonl"][:50])
  kept = (out / "part-00000.jsonl").stat().st_mtime_ns
  outputs = _run_processes(out, 2)
  assert _dataset(out) == reference  # the temporary file is gone
  assert (out / "part-00000.jsonl").stat().st_mtime_ns == kept  # not written again
  assert "self-distill:" not in outputs[0][0]  # process 0 had nothing to answer
  assert "self-distill: 2 conversations in" in outputs[1][0]
  assert "self-distill, all 2 processes: 2 conversations in" in outputs[0][0]


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


def test_batches_pad_to_their_bucket_or_with_one_width_to_the_prompt_cap():
  import ml_collections

  from train import selfdistill

  s = ml_collections.ConfigDict(dict(batch_size=4, max_prompt_tokens=256, one_width=False))
  prompts = [[5] * 40, [6] * 3, [7] * 33]
  tokens, lengths = selfdistill.batch_prompts(prompts, 0, s)
  assert tokens.shape == (4, 64) and lengths.tolist() == [40, 3, 33, 1]
  assert tokens[0, :40].tolist() == [5] * 40 and not tokens[0, 40:].any() and not tokens[3].any()
  s.one_width = True
  wide, wide_lengths = selfdistill.batch_prompts(prompts, 0, s)
  assert wide.shape == (4, 256) and wide_lengths.tolist() == lengths.tolist()
  assert (wide[:, :64] == tokens).all() and not wide[:, 64:].any()


def test_magpie_questions_are_the_targets_own_and_answered_by_it(tmp_path, smollm2):
  """source=magpie: each user turn is what the target writes after the chat template's user
  header (greedy here, so it can be recomputed), and its answer is the target's answer to it;
  a second run finds every shard written."""
  from configs import smollm2_135m
  from train import selfdistill

  config = smollm2_135m.get_config("smoke")
  config.selfdistill.update(
    source="magpie",
    out=str(tmp_path / "sd"),
    num_conversations=2,
    batch_size=8,  # over the test session's 8 CPU devices
    shard_size=8,
    question_temperature=0.0,
    max_question_tokens=12,
  )
  # A directory holding another dataset's shard is refused, not overwritten.
  (tmp_path / "sd").mkdir()
  other = tmp_path / "sd" / "part-00000.jsonl"
  other.write_text(json.dumps({"id": "sharegpt-1", "conversations": []}) + "\n")
  with pytest.raises(ValueError, match="holds other conversations"):
    selfdistill.run(config)
  other.unlink()
  selfdistill.run(config)
  (shard,) = sorted(os.listdir(tmp_path / "sd"))
  text = (tmp_path / "sd" / shard).read_text()
  records = [json.loads(line) for line in text.splitlines()]
  assert [r["id"] for r in records] == [f"magpie-{config.seed}-{i:07d}" for i in range(2)]
  header, _ = selfdistill.user_turn_template(smollm2[1])
  (question,) = _greedy_answers(smollm2, [header], max_new_tokens=12)
  assert question.strip()
  for r in records:
    user, answer = r["conversations"]
    assert user == {"from": "user", "value": question}
    # Answered from the prompt training renders from the record.
    assert [answer["value"]] == _greedy_answers(smollm2, [_prompt_ids(smollm2[1], r)])
  selfdistill.run(config)
  assert (tmp_path / "sd" / shard).read_text() == text
