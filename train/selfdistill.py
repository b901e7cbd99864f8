r"""Self-distillation data: prompts answered by the target itself.

  python -m train.selfdistill --config=configs/smollm2_135m.py

For the first `config.selfdistill.num_conversations` conversations of
`config.selfdistill.source` (both splits), the first user turn (and a system turn before it,
if any) is answered by the target through `pspec_jax.decode`, in batches, and written as
ShareGPT-style JSONL shards under `config.selfdistill.out`, which `train.distill` reads as
`config.data.source`.

With `config.selfdistill.source=magpie` no prompt file is read: the target writes each user
turn itself, sampled after the chat template's user header (Magpie, Xu et al. 2024) at
`question_temperature` / `question_top_p`, up to `max_question_tokens`, and then answers it.
Prompts are then as many as `num_conversations` asks, in the target's own distribution of
requests; conversation i is `magpie-<seed>-<i>`, so another `config.seed` writes new ones.

Shard i holds the prompts [i * shard_size, (i + 1) * shard_size) in source order. Each shard
is written to a temporary file and renamed when complete, so a killed run
loses at most the shards in progress; a restart skips the shards already written.

Several processes (`--config.distributed=True`, with `config.cluster` where jax.distributed
cannot find the cluster itself) write one dataset into the same directory: shard i is
answered by process i % process_count, on that process's devices (the batch over their data
axis). Batches, their padding and their sampling keys depend on the shard alone, so any number
of processes writes the same bytes. `selfdistill.out` is one directory that all of them see
(a shared file system), or one per host whose shards, disjoint by name, are gathered afterwards.
Every process waits for the others before it exits; a killed process ends the run (the others
stop when its heartbeats do), and the same command lines resume it. Two processes on one host:

  python -m train.selfdistill --config=configs/smollm2_135m.py --config.distributed=True \
    --config.cluster.coordinator_address=127.0.0.1:12355 --config.cluster.num_processes=2 \
    --config.cluster.process_id=0  # and =1 in a second shell

Each process prints conversations per hour (in its progress bar, and at the end).

On one GPU a single process leaves the device idle most of the time (the host tokenises,
renders and decodes text between batches). Independent runs side by side fill it: give each its
own `--config.seed` (Magpie conversation ids then differ) and `selfdistill.out`, and list the
directories in `data.source`. On an H200 three such runs wrote about 790,000 conversations an
hour together, where one alone had written 287,000 in an earlier run (the drafter README).
"""

import json
import os
import time

from absl import flags
from ml_collections import config_flags

from pspec_jax import cli

FLAGS = flags.FLAGS
# A week: the processes finish their shards at different times (one shard apart, more after a
# resume); the last one may take hours after the first.
_BARRIER_TIMEOUT_MS = 7 * 24 * 3600 * 1000
# The source whose user turns the target writes itself.
MAGPIE = "magpie"


def _prompts(config, tokenizer):
  """(id, turns before the first answer, prompt ids) of the source's first conversations.

  Both splits are answered: the held-out conversations (a fixed hash of the id, see
  `data.is_heldout`) stay held out when `train.distill` reads the output.
  """
  from pspec_jax import data

  s = config.selfdistill
  if s.source == MAGPIE:  # the target writes the user turns while answering (`_asker`)
    return [(f"{MAGPIE}-{config.seed}-{i:07d}", None, None) for i in range(s.num_conversations)]
  out = []
  source = data.read_conversations(
    s.source, config.data.tfds_data_dir or None, config.data.skip_malformed
  )
  for c in source:
    first = next(i for i, t in enumerate(c["turns"]) if t["role"] == "assistant")
    turns = c["turns"][:first]
    if not turns or turns[-1]["role"] != "user":
      continue
    ids = _render(tokenizer, turns)
    if len(ids) <= s.max_prompt_tokens:
      out.append((c["id"], turns, ids))
    if len(out) == s.num_conversations:
      break
  return out


def run(config) -> None:
  import jax
  from tqdm import tqdm

  from pspec_jax import checkpoints
  from train import build

  s = config.selfdistill
  if s.method not in ("none", "pld"):
    raise ValueError(f"selfdistill.method must be none or pld, got {s.method!r}")
  if s.shard_size % s.batch_size:
    raise ValueError("selfdistill.shard_size must be a multiple of selfdistill.batch_size")
  if os.path.exists(s.out) and not os.path.isdir(s.out):
    raise ValueError(f"selfdistill.out: {s.out} is a file, not a directory: give a directory")
  build.check_target_exists(config)
  if config.distributed:
    build.initialize_cluster(config.cluster)
  process, processes = jax.process_index(), jax.process_count()
  tokenizer = checkpoints.load_tokenizer(config.target.checkpoint)
  prompts = _prompts(config, tokenizer)
  os.makedirs(s.out, exist_ok=True)
  shards = [prompts[i : i + s.shard_size] for i in range(0, len(prompts), s.shard_size)]
  # Every process reads which shards are missing (for the totals); each answers its own.
  written = {i: _ids(_shard_path(s.out, i)) for i in range(len(shards))}
  for i, ids in written.items():
    if ids and not set(ids) & set(_cids(shards[i])):
      raise ValueError(
        f"selfdistill.out: {_shard_path(s.out, i)} holds other conversations (another source "
        "or seed?): give another --config.selfdistill.out, or move them away"
      )
  pending = [i for i in range(len(shards)) if written[i] != _cids(shards[i])]
  todo = [i for i in pending if i % processes == process]
  mine = sum(len(shards[i]) for i in range(process, len(shards), processes))
  todo_rows = sum(len(shards[i]) for i in todo)
  bar = tqdm(
    total=mine,
    initial=mine - todo_rows,
    desc="self-distill" + (f" (process {process}/{processes})" if processes > 1 else ""),
    unit="conv",
  )
  start = time.monotonic()
  if todo:
    answer = _answerer(config, tokenizer)
    for index in todo:
      shard, answers = answer(
        index, shards[index], lambda rows: _progress(bar, rows, todo_rows, start)
      )
      _write_shard(_shard_path(s.out, index), shard, answers)
  bar.close()
  if todo:
    print(f"self-distill: {_rate(todo_rows, start)}", flush=True)
  if processes > 1:
    _wait_for_all_processes()
    if process == 0 and pending:
      total = sum(len(shards[i]) for i in pending)
      print(f"self-distill, all {processes} processes: {_rate(total, start)}", flush=True)


def _answerer(config, tokenizer):
  """Loads the target and returns `answer(index, shard, progress) -> (shard, answers)`, which
  answers shard `index` in batches (first writing its user turns, for `magpie`), calling
  `progress(rows)` after each."""
  import jax
  import numpy as np

  from pspec_jax import checkpoints, decode, drafter_files, sharding
  from pspec_jax.sampling import SamplingConfig
  from train import build

  s = config.selfdistill
  # Each process decodes alone on its own devices: the batch over their data axis, the
  # (replicated) weights on each, in the layout that decodes fastest there (on one CPU device,
  # panels, whose kernels also run the attention: faster at a batch of 32 too).
  devices = jax.local_devices()
  mesh = None
  if len(devices) > 1:
    if s.batch_size % len(devices):
      raise ValueError(
        f"selfdistill.batch_size={s.batch_size} must divide over this process's "
        f"{len(devices)} devices"
      )
    mesh = sharding.make_mesh(data=len(devices), devices=devices)
  layout = checkpoints.decode_layout(mesh)
  target = build.load_target(config, scan_layers=False, weight_layout=layout)
  drafter = drafter_files.resolve_drafter(s.method, None, target, num_draft=4)
  if mesh is not None:
    target, drafter = decode.shard(mesh, target, drafter)
  cfg = decode.DecodeConfig(
    max_new_tokens=s.max_new_tokens,
    sampling=SamplingConfig(temperature=s.temperature),
    eos_ids=checkpoints.eos_token_ids(config.target.checkpoint, tokenizer),
    pad_id=tokenizer.pad_token_id or 0,
    mesh=mesh,
  )
  key = jax.random.key(config.seed)
  ask = _asker(config, tokenizer, target, drafter, cfg) if s.source == MAGPIE else None

  def answer(index, shard, progress):
    if ask is not None:
      shard = ask(index, shard)
    answers = [None] * len(shard)
    # Batches of similar prompt lengths. Batches stay within a shard: a batch, its padding and
    # its key (the shard's index and the batch's place in it) are then the same whichever
    # process answers the shard, so one process and many write the same dataset, sampling too.
    by_length = sorted(range(len(shard)), key=lambda i: len(shard[i][2]))
    for start in range(0, len(shard), s.batch_size):
      rows = by_length[start : start + s.batch_size]
      tokens, lengths = batch_prompts([shard[i][2] for i in rows], cfg.pad_id, s)
      batch_key = jax.random.fold_in(key, index * s.shard_size + start)
      out = jax.device_get(decode.generate(target, tokens, lengths, batch_key, cfg, drafter))
      for row, i in enumerate(rows):  # padding rows are dropped
        ids = np.asarray(out.tokens[row, : out.lengths[row]]).tolist()
        answers[i] = tokenizer.decode(ids, skip_special_tokens=True)
      progress(len(rows))
    return shard, answers

  return answer


def _asker(config, tokenizer, target, drafter, cfg):
  """`ask(index, shard) -> shard`: the shard with each conversation's user turn written by the
  target, sampled after the chat template's header of a user turn, in batches of the
  answers' size. A question's key is its batch's (the shard's index and the batch's place in
  it), so any number of processes writes the same questions."""
  import dataclasses

  import jax
  import numpy as np

  from pspec_jax import decode
  from pspec_jax.sampling import SamplingConfig

  s = config.selfdistill
  header, footer = user_turn_template(tokenizer)
  if len(header) + s.max_question_tokens + len(footer) > s.max_prompt_tokens:
    raise ValueError(
      f"selfdistill.max_question_tokens={s.max_question_tokens} leaves no room in "
      f"selfdistill.max_prompt_tokens={s.max_prompt_tokens} for the chat template's "
      f"{len(header) + len(footer)} tokens around a user turn"
    )
  question_cfg = dataclasses.replace(
    cfg,
    max_new_tokens=s.max_question_tokens,
    sampling=SamplingConfig(temperature=s.question_temperature, top_p=s.question_top_p),
  )
  # A stream of its own: the answers' keys fold in shard offsets, which never reach 2**32 - 1.
  question_key = jax.random.fold_in(jax.random.key(config.seed), np.uint32(0xFFFFFFFF))
  eos = set(cfg.eos_ids)
  tokens = np.tile(np.asarray(header, np.int32), (s.batch_size, 1))
  lengths = np.full(s.batch_size, len(header), np.int32)

  def ask(index, shard):
    asked = []
    for start in range(0, len(shard), s.batch_size):
      batch_key = jax.random.fold_in(question_key, index * s.shard_size + start)
      out = jax.device_get(
        decode.generate(target, tokens, lengths, batch_key, question_cfg, drafter)
      )
      for row, (cid, _, _) in enumerate(shard[start : start + s.batch_size]):
        ids = np.asarray(out.tokens[row, : out.lengths[row]]).tolist()
        if ids and ids[-1] in eos:
          ids = ids[:-1]
        turns = [{"role": "user", "content": tokenizer.decode(ids, skip_special_tokens=True)}]
        asked.append((cid, turns, _rendered(tokenizer, turns, s.max_prompt_tokens)))
    return asked

  return ask


def _rendered(tokenizer, turns, max_tokens: int) -> list[int]:
  """The prompt ids of a written question as training renders its text (the chat template),
  the question cut at its end in the rare case that its text tokenises longer than sampled."""
  while True:
    ids = _render(tokenizer, turns)
    if len(ids) <= max_tokens:
      return ids
    cut = tokenizer(turns[0]["content"], add_special_tokens=False).input_ids[:-1]
    turns[0]["content"] = tokenizer.decode(cut)


def _render(tokenizer, turns) -> list[int]:
  """Prompt ids of the turns before an answer, in the chat template (as training renders them)."""
  text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
  return tokenizer(text, add_special_tokens=False).input_ids


def user_turn_template(tokenizer) -> tuple[list[int], list[int]]:
  """The chat template's token ids before and after a lone user turn's text (the header
  includes the template's default system turn, if it has one)."""
  marker = "\x00USER-TURN\x00"
  text = tokenizer.apply_chat_template(
    [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
  )
  header, footer = text.split(marker)
  return (
    tokenizer(header, add_special_tokens=False).input_ids,
    tokenizer(footer, add_special_tokens=False).input_ids,
  )


def batch_prompts(prompts: list[list[int]], pad_id: int, s) -> tuple:
  """One batch of prompt ids as (tokens [batch_size, W], lengths [batch_size]), rows past the
  prompts padded (length 1, dropped from the answers).

  W is the power of two above the longest prompt, at most `s.max_prompt_tokens`: less prefill
  and a shorter cache to attend over than one width for all, for a few compilations. With
  `s.one_width`, W is `s.max_prompt_tokens` for every batch: one compilation, for accelerators,
  where compiling a width costs more than the padding does.
  """
  import numpy as np

  from pspec_jax import prompts as prompts_lib

  tokens, lengths = prompts_lib.pad_batch(prompts, pad_id, max_width=s.max_prompt_tokens)
  width = s.max_prompt_tokens if s.one_width else tokens.shape[1]
  pad_rows = s.batch_size - len(prompts)
  tokens = np.pad(tokens, ((0, pad_rows), (0, width - tokens.shape[1])), constant_values=pad_id)
  return tokens, np.pad(lengths, (0, pad_rows), constant_values=1)


def _write_shard(path: str, shard, answers) -> None:
  """Writes a shard's records to a temporary file, renamed when complete: a killed run leaves
  no partial shard under the final name."""
  records = [
    {
      "id": cid,
      "conversations": [{"from": t["role"], "value": t["content"]} for t in turns]
      + [{"from": "gpt", "value": answer}],
    }
    for (cid, turns, _), answer in zip(shard, answers, strict=True)
  ]
  with open(path + ".tmp", "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(path + ".tmp", path)


def _progress(bar, rows: int, todo_rows: int, start: float) -> None:
  bar.update(rows)
  answered = bar.n - (bar.total - todo_rows)  # in this run
  bar.set_postfix_str(f"{_per_hour(answered, start):,.0f} conv/h")


def _per_hour(conversations: int, start: float) -> float:
  return conversations * 3600 / max(time.monotonic() - start, 1e-9)


def _rate(conversations: int, start: float) -> str:
  """The measurement: conversations answered per hour of wall time since the target was
  loaded (loading and compilation included)."""
  seconds = time.monotonic() - start
  return (
    f"{conversations} conversations in {seconds:.0f} s: "
    f"{_per_hour(conversations, start):,.0f} conversations per hour"
  )


def _wait_for_all_processes() -> None:
  """Blocks until every process has written its shards. A process that is done would
  otherwise leave at once, and jax.distributed's shutdown waits for the others only minutes;
  a process that dies ends the wait with an error (its heartbeats stop)."""
  from jax._src import distributed

  distributed.global_state.client.wait_at_barrier(
    "selfdistill_done", timeout_in_ms=_BARRIER_TIMEOUT_MS
  )


def _ids(path: str) -> list[str]:
  """The conversation ids a written shard holds (none if it is missing). A shard whose ids
  differ from what the config asks for (the last one, after `num_conversations` was raised)
  is answered again; one that shares none of them (another source or seed) stops the run
  instead of being overwritten."""
  if not os.path.exists(path):
    return []
  with open(path) as fh:
    return [json.loads(line)["id"] for line in fh]


def _cids(shard) -> list[str]:
  return [c[0] for c in shard]


def _shard_path(out: str, index: int) -> str:
  return os.path.join(out, f"part-{index:05d}.jsonl")


def main():
  run(FLAGS.config)


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
  flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
  cli.run(main, define_flags)
