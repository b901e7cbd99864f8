r"""Self-distillation data: ShareGPT prompts answered by the target itself.

  python -m train.selfdistill --config=configs/smollm2_135m.py

For the first `config.selfdistill.num_conversations` conversations of
`config.selfdistill.source` (both splits), the first user turn (and a system turn before it,
if any) is answered by the target through `pspec_jax.decode`, in batches, and written as
ShareGPT-style JSONL shards under `config.selfdistill.out`, which `train.distill` reads as
`config.data.source`. Each shard is written to a temporary file and
renamed when complete, so a killed run loses at most the shard in progress; a restart skips
the shards already written.
"""

import json
import os

from absl import flags
from ml_collections import config_flags

from pspec_jax import cli

FLAGS = flags.FLAGS


def _prompts(config, tokenizer):
  """(id, turns before the first answer, prompt ids) of the source's first conversations.

  Both splits are answered: the held-out conversations (a fixed hash of the id, see
  `data.is_heldout`) stay held out when `train.distill` reads the output.
  """
  from pspec_jax import data

  s = config.selfdistill
  out = []
  source = data.read_conversations(
    s.source, config.data.tfds_data_dir or None, config.data.skip_malformed
  )
  for c in source:
    first = next(i for i, t in enumerate(c["turns"]) if t["role"] == "assistant")
    turns = c["turns"][:first]
    if not turns or turns[-1]["role"] != "user":
      continue
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) <= s.max_prompt_tokens:
      out.append((c["id"], turns, ids))
    if len(out) == s.num_conversations:
      break
  return out


def run(config) -> None:
  import jax
  import numpy as np
  import transformers
  from tqdm import tqdm

  from pspec_jax import checkpoints, decode, drafter_files
  from pspec_jax import prompts as prompts_lib
  from pspec_jax.sampling import SamplingConfig
  from train import build

  transformers.logging.set_verbosity_error()
  s = config.selfdistill
  if s.method not in ("none", "pld"):
    raise ValueError(f"selfdistill.method must be none or pld, got {s.method!r}")
  if s.shard_size % s.batch_size:
    raise ValueError("selfdistill.shard_size must be a multiple of selfdistill.batch_size")
  if os.path.exists(s.out) and not os.path.isdir(s.out):
    raise ValueError(f"selfdistill.out: {s.out} is a file, not a directory: give a directory")
  build.check_target_exists(config)
  tokenizer = checkpoints.load_tokenizer(config.target.checkpoint)
  prompts = _prompts(config, tokenizer)
  os.makedirs(s.out, exist_ok=True)
  shards = [prompts[i : i + s.shard_size] for i in range(0, len(prompts), s.shard_size)]
  todo = [i for i in range(len(shards)) if _ids(_shard_path(s.out, i)) != [c[0] for c in shards[i]]]
  bar = tqdm(total=len(prompts), desc="self-distill", unit="conv")
  bar.update(sum(len(shards[i]) for i in range(len(shards)) if i not in todo))
  if not todo:
    bar.close()
    return
  # Plain weights: with 32 rows per matmul the CPU's panel layout is slower (it pays from one
  # row to a few, the verification of a small tree).
  target = build.load_target(config, scan_layers=False, weight_layout="plain")
  drafter = drafter_files.resolve_drafter(s.method, None, target, num_draft=4)
  cfg = decode.DecodeConfig(
    max_new_tokens=s.max_new_tokens,
    sampling=SamplingConfig(temperature=s.temperature),
    eos_ids=checkpoints.eos_token_ids(config.target.checkpoint, tokenizer),
    pad_id=tokenizer.pad_token_id or 0,
  )
  key = jax.random.key(config.seed)
  for index in todo:
    shard = shards[index]
    answers = [None] * len(shard)
    # Batches of similar prompt lengths, each padded to its own width (a power of two, at most
    # max_prompt_tokens): less prefill and a shorter cache to attend over than one width for
    # all, for a few compilations.
    by_length = sorted(range(len(shard)), key=lambda i: len(shard[i][2]))
    for start in range(0, len(shard), s.batch_size):
      rows = by_length[start : start + s.batch_size]
      tokens, lengths = prompts_lib.pad_batch(
        [shard[i][2] for i in rows], cfg.pad_id, max_width=s.max_prompt_tokens
      )
      tokens = np.pad(tokens, ((0, s.batch_size - len(rows)), (0, 0)), constant_values=cfg.pad_id)
      lengths = np.pad(lengths, (0, s.batch_size - len(rows)), constant_values=1)
      batch_key = jax.random.fold_in(key, index * s.shard_size + start)
      out = jax.device_get(decode.generate(target, tokens, lengths, batch_key, cfg, drafter))
      for row, i in enumerate(rows):  # padding rows are dropped
        ids = np.asarray(out.tokens[row, : out.lengths[row]]).tolist()
        answers[i] = tokenizer.decode(ids, skip_special_tokens=True)
      bar.update(len(rows))
    records = [
      {
        "id": cid,
        "conversations": [{"from": t["role"], "value": t["content"]} for t in turns]
        + [{"from": "gpt", "value": answer}],
      }
      for (cid, turns, _), answer in zip(shard, answers, strict=True)
    ]
    path = _shard_path(s.out, index)
    with open(path + ".tmp", "w") as fh:
      fh.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)
  bar.close()


def _ids(path: str) -> list[str]:
  """The conversation ids a written shard holds (none if it is missing). A shard whose ids
  differ from what the config asks for (the last one, after `num_conversations` was raised,
  or another source) is answered again."""
  if not os.path.exists(path):
    return []
  with open(path) as fh:
    return [json.loads(line)["id"] for line in fh]


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
