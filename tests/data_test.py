"""Training data: conversation files, chat rendering with assistant masks, split, batches."""

import json

import numpy as np
import pytest

from pspec_jax import data


class CharTokenizer:
  """One token per character and a ChatML-like template: enough to check rendering."""

  name_or_path = "chars"
  pad_token_id = 0

  def __len__(self):
    return 256

  def __call__(self, text, add_special_tokens=False):
    class Out:
      input_ids = [ord(c) % 256 for c in text]

    return Out()

  def apply_chat_template(self, turns, add_generation_prompt=False, tokenize=False):
    text = "".join(f"<{t['role'][0]}>{t['content']}|" for t in turns)
    return text + ("<a>" if add_generation_prompt else "")


TURNS = [
  {"role": "user", "content": "hi"},
  {"role": "assistant", "content": "yo"},
  {"role": "user", "content": "q?"},
  {"role": "assistant", "content": "ok"},
]


def test_render_masks_exactly_the_assistant_turns():
  ids, mask = data.render(CharTokenizer(), TURNS, seq_len=64)
  text = "".join(chr(i) for i in ids)
  assert text == "<u>hi|<a>yo|<u>q?|<a>ok|"
  trained = "".join(c for c, m in zip(text, mask, strict=True) if m)
  assert trained == "yo|ok|"  # content and end-of-turn marker, never the prompt


def test_render_truncates_and_drops_untrainable():
  ids, mask = data.render(CharTokenizer(), TURNS, seq_len=11)
  assert len(ids) == len(mask) == 11 and sum(mask) == 2  # "<u>hi|<a>yo" -> "yo"
  assert data.render(CharTokenizer(), TURNS, seq_len=6) is None  # no answer token fits


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


def test_truncated_json_array_and_jsonl(tmp_path):
  records = [
    {
      "id": str(i),
      "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
    }
    for i in range(3)
  ]
  text = json.dumps(records, indent=1)
  cut = tmp_path / "cut.json"
  cut.write_text(text[: text.rindex('"a"')])  # the last record is cut short
  assert [c["id"] for c in data.read_conversations(str(cut))] == ["0", "1"]
  lines = tmp_path / "d"
  lines.mkdir()
  (lines / "part-0.jsonl").write_text(
    "".join(json.dumps(r) + "\n" for r in records) + '{"id": "3", "conv'
  )
  assert [c["id"] for c in data.read_conversations(str(lines))] == ["0", "1", "2"]


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
  d = data.TokenData(tokens=tokens, loss_mask=tokens % 2 == 0, lengths=np.full(n, 4, np.int32))
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
  tokens = data.tokenise(conversations, tokenizer, seq_len=256)
  assert tokens.tokens.shape[1] == 256 and len(tokens) >= 4
  row = tokens.tokens[0][: tokens.lengths[0]]
  trained = row[tokens.loss_mask[0][: tokens.lengths[0]]]
  first = int(np.argmax(tokens.loss_mask[0]))
  # Training starts right after the generation prompt "<|im_start|>assistant\n".
  assert tokenizer.decode(row[:first]).endswith("<|im_start|>assistant\n")
  assert "<|im_start|>" not in tokenizer.decode(trained)
