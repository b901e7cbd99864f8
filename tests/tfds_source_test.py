"""The `tfds:` data source: a tiny TFDS dataset prepared locally, read without TensorFlow."""

import pytest
import tensorflow_datasets as tfds

from pspec_jax import data, testing

CONVERSATIONS = [
  [("human", f"question {i}"), ("gpt", f"answer {i}"), ("human", "more?"), ("gpt", "no")]
  for i in range(6)
]


class TinyChat(tfds.core.GeneratorBasedBuilder):
  """Six ShareGPT-style conversations in array_record files."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    turn = {"from": tfds.features.Text(), "value": tfds.features.Text()}
    features = {"id": tfds.features.Text(), "conversations": tfds.features.Sequence(turn)}
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i, turns in enumerate(CONVERSATIONS):
      conversation = [{"from": who, "value": text} for who, text in turns]
      yield str(i), {"id": f"tiny-{i}", "conversations": conversation}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tfds")
  TinyChat(data_dir=str(path), file_format="array_record").download_and_prepare()
  return str(path)


def test_tfds_conversations_are_read_in_order(data_dir):
  conversations = data.read_conversations("tfds:tiny_chat", tfds_data_dir=data_dir)
  # array_record keeps TFDS's shuffled order; the ids and turns are what was written.
  assert sorted(c["id"] for c in conversations) == [f"tiny-{i}" for i in range(6)]
  by_id = {c["id"]: c["turns"] for c in conversations}
  assert by_id["tiny-3"] == [
    {"role": "user", "content": "question 3"},
    {"role": "assistant", "content": "answer 3"},
    {"role": "user", "content": "more?"},
    {"role": "assistant", "content": "no"},
  ]


def test_tfds_source_tokenises_and_caches(data_dir, tmp_path):
  kwargs = dict(seq_len=48, heldout_per_mille=0, cache_dir=str(tmp_path), tfds_data_dir=data_dir)
  first = data.load_token_data("tfds:tiny_chat", testing.CharTokenizer(), split="train", **kwargs)
  again = data.load_token_data("tfds:tiny_chat", testing.CharTokenizer(), split="train", **kwargs)
  assert len(first) == 6 and (first.tokens == again.tokens).all()
  row = first.tokens[0][first.loss_mask[0]]
  assert "".join(map(chr, row)).startswith("answer ")


def test_unknown_tfds_dataset_is_one_clear_error(tmp_path):
  with pytest.raises(ValueError, match="TFDS dataset 'no_such_set' not found"):
    data.read_conversations("tfds:no_such_set", tfds_data_dir=str(tmp_path))
