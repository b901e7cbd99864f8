"""Training data: conversation files, chat rendering with assistant masks, split, batches."""

import json

import numpy as np
import pytest

from pspec_jax import data, testing
from pspec_jax import prompts as prompts_lib

TURNS = [
  {"role": "user", "content": "hi"},
  {"role": "assistant", "content": "yo"},
  {"role": "user", "content": "q?"},
  {"role": "assistant", "content": "ok"},
]


def test_render_masks_exactly_the_assistant_turns():
  ids, mask = data.render(testing.CharTokenizer(), TURNS, seq_len=64)
  text = "".join(chr(i) for i in ids)
  assert text == "<u>hi|<a>yo|<u>q?|<a>ok|"
  trained = "".join(c for c, m in zip(text, mask, strict=True) if m)
  assert trained == "yo|ok|"  # content and end-of-turn marker, never the prompt


def test_render_truncates_and_drops_untrainable():
  ids, mask = data.render(testing.CharTokenizer(), TURNS, seq_len=11)
  assert len(ids) == len(mask) == 11 and sum(mask) == 2  # "<u>hi|<a>yo" -> "yo"
  assert data.render(testing.CharTokenizer(), TURNS, seq_len=6) is None  # no answer token fits


def test_normalise_roles_and_leading_answers():
  record = {
    "id": "x",
    "conversations": [
      {"from": "gpt", "value": "dropped"},
      {"from": "human", "value": "a"},
      {"from": "chatgpt", "value": "b"},
    ],
  }
  assert data.normalise(record)["turns"] == [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
  ]
  assert data.normalise({"id": "y", "conversations": [{"from": "human", "value": "a"}]}) is None


def _records(n):
  return [
    {
      "id": str(i),
      "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
    }
    for i in range(n)
  ]


def test_a_file_cut_inside_its_last_record_is_an_error_unless_it_is_the_packaged_one(
  tmp_path, monkeypatch
):
  text = json.dumps(_records(3), indent=1)
  cut = tmp_path / "cut.json"
  cut.write_text(text[: text.rindex('"a"')])  # the last record is cut short
  line = text[: text.rindex('{\n  "id": "2"')].count("\n") + 1
  with pytest.raises(ValueError, match=rf"cut.json:{line}: the file ends inside this record"):
    data.read_conversations(str(cut))
  lines = tmp_path / "d"
  lines.mkdir()
  (lines / "part-0.jsonl").write_text(
    "".join(json.dumps(r) + "\n" for r in _records(3)) + '{"id": "3", "conv'
  )
  with pytest.raises(ValueError, match=r"part-0.jsonl:4: not valid JSON"):
    data.read_conversations(str(lines))
  # The packaged ShareGPT file ends inside its last record: that record alone is left out.
  monkeypatch.setattr(data, "sharegpt_path", lambda: str(cut))
  assert [c["id"] for c in data.read_conversations("sharegpt")] == ["0", "1"]


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_a_malformed_record_in_the_middle_names_file_and_line(tmp_path, suffix):
  """Before, a JSON-lines file was read up to its first bad line, silently."""
  records = _records(6)
  path = tmp_path / f"data.{suffix}"
  if suffix == "jsonl":
    lines = [json.dumps(r) for r in records]
    lines[3] = lines[3][:-5]  # line 4 cut short
    path.write_text("\n".join(lines) + "\n")
    where = 4
  else:
    text = json.dumps(records, indent=1)
    at = text.index('"id": "3"')
    text = text[:at] + text[at:].replace('"value": "q"', '"value": q', 1)
    path.write_text(text)
    where = text[:at].count("\n")  # the line of the record's opening brace
  with pytest.raises(ValueError, match=rf"data.{suffix}:{where}: not valid JSON .*skip_malformed"):
    data.read_conversations(str(path))


def test_skipped_malformed_records_are_counted_in_a_warning(tmp_path, caplog):
  lines = [json.dumps(r) for r in _records(6)]
  lines[0] = "{oops"  # near the top: before, "no conversation has assistant tokens ..."
  lines[3] = '"a string"'
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=r"data.jsonl:1: not valid JSON"):
    data.read_conversations(str(path))
  with caplog.at_level("WARNING"):
    got = data.read_conversations(str(path), skip_malformed=True)
  assert [c["id"] for c in got] == ["1", "2", "4", "5"]
  assert "2 malformed record(s) skipped: " in caplog.text and "(lines 1, 4)" in caplog.text
  text = json.dumps(_records(4), indent=1)
  at = text.index('"id": "1"')
  broken = tmp_path / "broken.json"
  broken.write_text(text[:at] + text[at:].replace('"q"', "q", 1))
  assert [c["id"] for c in data.read_conversations(str(broken), skip_malformed=True)] == [
    "0",
    "2",
    "3",
  ]


def test_a_json_array_of_strings_is_one_error(tmp_path):
  path = tmp_path / "strings.json"
  path.write_text(json.dumps(["hello", "world"]))
  with pytest.raises(ValueError, match=r"strings.json:1: expected a JSON object .*got str"):
    data.read_conversations(str(path))
  turns = tmp_path / "turns.jsonl"
  turns.write_text(json.dumps({"id": "x", "conversations": ["hi", "yo"]}) + "\n")
  with pytest.raises(ValueError, match=r'turns.jsonl:1: "conversations" must be a list'):
    data.read_conversations(str(turns))


def test_prompts_naming_a_directory_say_so(tmp_path):
  with pytest.raises(ValueError, match=rf"prompts: {tmp_path} is a directory"):
    prompts_lib.prompts_from(str(tmp_path))


def test_unknown_source_is_one_clear_error():
  with pytest.raises(ValueError, match="unknown data source"):
    data.read_conversations("no/such/source.json")


def test_heldout_split_is_fixed_and_about_the_right_size():
  ids = [f"conv{i}" for i in range(5000)]
  held = [i for i in ids if data.is_heldout(i, 20)]
  assert held == [i for i in ids if data.is_heldout(i, 20)]
  assert 60 < len(held) < 140  # 2%


def test_batches_are_a_function_of_the_step():
  n = 10
  tokens = np.arange(n * 4, dtype=np.int32).reshape(n, 4)
  d = data.TokenData(tokens=tokens, loss_mask=tokens % 2 == 0, segments=np.ones_like(tokens))
  first = [d.batch(step, 3, seed=1)["tokens"][:, 0] // 4 for step in range(8)]
  again = [d.batch(step, 3, seed=1)["tokens"][:, 0] // 4 for step in range(8)]
  assert all((a == b).all() for a, b in zip(first, again, strict=True))
  rows = np.concatenate(first)
  # Every epoch (10 rows) visits each conversation once, in a new order.
  assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:20]) == list(range(10))
  assert list(rows[:10]) != list(rows[10:20])


def test_sharegpt_conversations_render_with_the_real_template(smollm2):
  _, tokenizer = smollm2
  conversations = data.read_conversations("sharegpt")[:8]
  tokens = data.tokenise(conversations, tokenizer, seq_len=256, packed=False)
  assert tokens.tokens.shape[1] == 256 and len(tokens) >= 4
  length = int((tokens.segments[0] > 0).sum())
  row = tokens.tokens[0][:length]
  trained = row[tokens.loss_mask[0][:length]]
  first = int(np.argmax(tokens.loss_mask[0]))
  # Training starts right after the generation prompt "<|im_start|>assistant\n".
  assert tokenizer.decode(row[:first]).endswith("<|im_start|>assistant\n")
  assert "<|im_start|>" not in tokenizer.decode(trained)


def test_pack_is_best_fit_and_never_overflows():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 65, size=300).tolist()
  rows = data.pack(lengths, 64)
  assert sorted(i for row in rows for i in row) == list(range(300))  # each exactly once
  assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
  assert all(row == sorted(row) for row in rows)  # conversations keep their order in a row
  # Best fit wastes little: within 10% of the lower bound on rows.
  assert len(rows) <= 1.1 * sum(lengths) / 64 + 1
  assert data.pack([30, 40, 30, 34], 64) == [[0, 2], [1], [3]]


def test_packed_rows_keep_each_conversation_whole():
  conversations = [
    {"id": str(i), "turns": [dict(TURNS[0], content="x" * i), TURNS[1]]} for i in range(1, 9)
  ]
  packed = data.tokenise(conversations, testing.CharTokenizer(), seq_len=40)
  alone = data.tokenise(conversations, testing.CharTokenizer(), seq_len=40, packed=False)
  assert len(packed) < len(alone) == 8
  pieces = []
  for tokens, mask, segments in zip(packed.tokens, packed.loss_mask, packed.segments, strict=True):
    for segment in range(1, segments.max() + 1):
      where = segments == segment
      assert where.nonzero()[0].tolist() == list(
        range(where.argmax(), where.argmax() + where.sum())
      )
      pieces.append(("".join(map(chr, tokens[where])), mask[where].tolist()))
  for tokens, mask, segments in zip(alone.tokens, alone.loss_mask, alone.segments, strict=True):
    where = segments == 1
    assert ("".join(map(chr, tokens[where])), mask[where].tolist()) in pieces
  assert len(pieces) == 8


def test_frequent_tokens_and_coverage():
  tokens = np.array([[5, 5, 5, 2, 2, 9, 7, 0]], np.int32)
  mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0]], bool)
  d = data.TokenData(tokens=tokens, loss_mask=mask, segments=np.ones_like(tokens))
  vocab = data.frequent_tokens(d, 3)
  assert vocab.tolist() == [5, 2, 9] and vocab.dtype == np.int32
  assert data.coverage(d, vocab[:2]) == pytest.approx(5 / 6)


def test_a_token_is_in_a_loop_when_the_tokens_before_it_occurred_earlier():
  answer = [1, 2, 3, 4, 1, 2, 3, 9, 5]
  # aligned to answer[1:]: tokens 7 and 8 follow (1, 2, 3) and (2, 3, 9); only (1, 2, 3) was
  # seen before. Token 7 breaks the loop (9, not 4) and still counts as in it.
  np.testing.assert_array_equal(data.in_loop(answer), [0, 0, 0, 0, 0, 0, 1, 0])
  np.testing.assert_array_equal(data.in_loop(answer, n=1), [0, 0, 0, 0, 1, 1, 1, 0])


def test_mask_loops_drops_loop_tokens_of_each_answer_from_the_loss():
  # Row 0 packs two conversations; in each, prompt tokens (mask 0) precede the answer (mask 1).
  tokens = np.array(
    [
      [7, 1, 2, 3, 1, 2, 3, 1, 8, 1, 2, 3, 1, 2, 0],
      [5, 6, 5, 6, 5, 6, 5, 1, 2, 3, 1, 2, 3, 1, 0],
    ],
    np.int32,
  )
  mask = np.array(
    [
      [0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0],
      [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0],
    ],
    bool,
  )
  segments = np.array(
    [[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0], [1] * 14 + [0]],
    np.int32,
  )
  masked = data.mask_loops(data.TokenData(tokens=tokens, loss_mask=mask, segments=segments))
  # Conversation 1's answer 1 2 3 1 2 3 1: the last token follows (1, 2, 3) seen before.
  # Conversation 2's answer 1 2 3 1 2 starts afresh (nothing carries over from the first).
  # Row 1: the prompt's 5 6 loop is not trained anyway; the answer is judged on its own.
  np.testing.assert_array_equal(
    masked.loss_mask,
    [
      [0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0],
      [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
    ],
  )
  np.testing.assert_array_equal(masked.tokens, tokens)
  assert mask.sum() == 19  # the input is left as it was
