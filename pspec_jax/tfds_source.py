"""Conversation corpora kept in TensorFlow Datasets format, read without TensorFlow.

`data.source = 'tfds:NAME[/CONFIG]'` reads the `train` split of a prepared TFDS dataset
through `tfds.data_source` (random access over array_record files; tensorflow-datasets and
array_record come with the project's `tfds` extra, TensorFlow itself is not needed). The
dataset is looked up in `data_dir` (default: TFDS's own, `$TFDS_DATA_DIR` or
`~/tensorflow_datasets`).

Each example must hold a conversation in ShareGPT or chat-messages form:
`conversations: [{from, value}, ...]` or `messages: [{role, content}, ...]`, stored either as
a list of turns or, as TFDS stores a `Sequence` of dicts, as a dict of equal-length lists.
An optional `id` names the conversation (it decides the held-out split); otherwise the
example's index does.
"""

from collections.abc import Iterator

__all__ = ["read"]

SPLIT = "train"


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _turns(value) -> list[dict]:
  """A list of turn dicts from either storage form, with text values."""
  if isinstance(value, dict):  # columnar: {"from": [...], "value": [...]}
    keys = list(value)
    count = len(value[keys[0]]) if keys else 0
    value = [{k: value[k][i] for k in keys} for i in range(count)]
  return [{k: _text(v) for k, v in turn.items()} for turn in value]


def read(name: str, data_dir: str | None = None) -> Iterator[dict]:
  """ShareGPT-style records {"id", "conversations" | "messages"} of a TFDS dataset's train split.

  Args:
    name: `NAME` or `NAME/CONFIG` of a prepared dataset.
    data_dir: where it was prepared (None: TFDS's default).
  """
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise ValueError(
      "a tfds: data source needs tensorflow-datasets and array_record: pip install -e '.[tfds]'"
    ) from None
  try:
    sources = tfds.data_source(name, data_dir=data_dir, split=None)
  except Exception as e:  # TFDS raises its own error types for unknown or unprepared data
    where = data_dir or "the default TFDS data directory"
    raise ValueError(f"TFDS dataset {name!r} not found in {where}: {e}".splitlines()[0]) from None
  if SPLIT not in sources:
    raise ValueError(f"TFDS dataset {name!r} has no {SPLIT!r} split (has {sorted(sources)})")
  source = sources[SPLIT]
  for index in range(len(source)):
    example = source[index]
    record = {"id": _text(example["id"]) if "id" in example else f"{name}/{index}"}
    for field in ("conversations", "messages"):
      if field in example:
        record[field] = _turns(example[field])
    yield record
