"""Records of conversation files (a JSON array, or JSON lines), read without losing any.

A record that does not parse, or is not a JSON object, stops the reading with an error that
names the file and the line. With `skip_malformed`, such records are skipped instead and
counted (`Skipped`), for the caller to report. One exception: a file that ends inside its last
record (a cut download; the packaged ShareGPT file is one) is read up to that record when the
caller allows it (`cut_end_ok`).
"""

import dataclasses
import json
from collections.abc import Iterator

__all__ = ["Skipped", "read"]

# Keys a conversation record has (ShareGPT's, or the chat "messages" convention).
_RECORD_KEYS = ("conversations", "messages", "id")


@dataclasses.dataclass
class Skipped:
  """Malformed records skipped, per file: {path: [line, ...]}."""

  lines: dict[str, list[int]] = dataclasses.field(default_factory=dict)

  def add(self, path: str, line: int) -> None:
    self.lines.setdefault(path, []).append(line)

  def __len__(self) -> int:
    return sum(map(len, self.lines.values()))

  def summary(self) -> str:
    """`N malformed records skipped: file (lines 3, 9), ...`."""
    parts = [
      f"{path} (line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines[:10]))}"
      + (", ..." if len(lines) > 10 else "")
      + ")"
      for path, lines in self.lines.items()
    ]
    return f"{len(self)} malformed record(s) skipped: {'; '.join(parts)}"


def _malformed(path: str, line: int, what: str) -> ValueError:
  return ValueError(
    f"{path}:{line}: {what}: fix or remove that record, or set data.skip_malformed=True to "
    "skip malformed records (they are counted in a warning)"
  )


def _check(record) -> str | None:
  """Why a parsed record is not a conversation record, or None."""
  if not isinstance(record, dict):
    return f"expected a JSON object (a conversation), got {type(record).__name__}"
  turns = record.get("conversations", record.get("messages"))
  if turns is not None and not (
    isinstance(turns, list) and all(isinstance(t, dict) for t in turns)
  ):
    key = "conversations" if "conversations" in record else "messages"
    return f'"{key}" must be a list of objects (turns)'
  return None


def read(
  path: str, *, skip_malformed: bool = False, skipped: Skipped | None = None, cut_end_ok=False
) -> Iterator[tuple[int, dict]]:
  """(line, record) for every record of a JSON array or JSON-lines file, in order.

  Args:
    path: the file.
    skip_malformed: skip (and add to `skipped`) records that fail to parse or are not
      conversation objects, instead of raising.
    skipped: where skipped records are counted.
    cut_end_ok: a file that ends inside its last record ends there, silently.

  Raises:
    ValueError: naming the file and line of the first malformed record.
  """
  skipped = skipped if skipped is not None else Skipped()
  with open(path, encoding="utf-8", errors="replace") as fh:
    text = fh.read()
  start = len(text) - len(text.lstrip())
  if not text[start:].startswith("["):
    for number, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        why = _check(record)
      except ValueError as e:
        why = f"not valid JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e})"
        record = None
      if why is None:
        yield number, record
      elif skip_malformed:
        skipped.add(path, number)
      else:
        raise _malformed(path, number, why)
    return
  yield from _array(text, start + 1, path, skip_malformed, skipped, cut_end_ok)


def _array(text, i, path, skip_malformed, skipped, cut_end_ok):
  decoder = json.JSONDecoder()
  counted = [0, 1]  # (position, its line): lines are counted forward, once

  def line_of(at: int) -> int:
    pos, line = counted
    line += text.count("\n", pos, at) if at >= pos else -text.count("\n", at, pos)
    counted[:] = [at, line]
    return line

  closed = text.rstrip().endswith("]")
  while True:
    while i < len(text) and text[i] in " \t\r\n,":
      i += 1
    if i >= len(text) or text[i] == "]":
      if i >= len(text) and not (closed or cut_end_ok or skip_malformed):
        raise _malformed(path, line_of(i), "the JSON array is not closed (file cut short?)")
      return
    try:
      record, end = decoder.raw_decode(text, i)
    except json.JSONDecodeError as e:
      cut = not closed and _last_record(text, i, decoder)
      if cut and cut_end_ok:
        return  # a file cut inside its last record
      why = "the file ends inside this record (cut short?)" if cut else f"not valid JSON ({e.msg})"
      if not skip_malformed:
        raise _malformed(path, line_of(i), why) from None
      skipped.add(path, line_of(i))
      i = _next_record(text, i + 1, decoder)
      continue
    line = line_of(i)
    why = _check(record)
    if why is not None:
      if not skip_malformed:
        raise _malformed(path, line, why)
      skipped.add(path, line)
    else:
      yield line, record
    i = end


def _next_record(text: str, i: int, decoder) -> int:
  """Where the next record that parses starts after a malformed one (the end if none)."""
  while (i := text.find("{", i)) >= 0:
    try:
      record, _ = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      i += 1
      continue
    if isinstance(record, dict) and any(k in record for k in _RECORD_KEYS):
      return i
    i += 1
  return len(text)


def _last_record(text: str, i: int, decoder) -> bool:
  """No later record parses: the failure at `i` is the file's last record."""
  return _next_record(text, i + 1, decoder) == len(text)
