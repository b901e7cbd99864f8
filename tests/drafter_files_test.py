"""Drafter files: save/load round trips for every kind, one clear error per bad file, and the
command line's `resolve_drafter`."""

import json
import os

import jax
import numpy as np
import pytest
from etils import epath
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from pspec_jax import decode, drafter_files, llama, sampling, testing, tree_specs
from pspec_jax import drafter as drafter_lib


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


# Every kind, with settings away from the defaults so that a field dropped on the way shows.
SETTINGS = {
  "pspec": dict(
    num_draft=3,
    tree="sparse6",
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=24,
    rope_theta=500.0,
    rope_scaling=llama.RopeScaling(
      factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
    rms_norm_eps=1e-6,
  ),
  "eagle": dict(num_draft=3, tree="dynamic:5", sampling_tree="chain", draft_vocab_size=11),
  "medusa": dict(num_draft=4, tree="sparse8", draft_vocab_size=7),
  "pld": dict(num_draft=5, tree="chain", max_ngram=4),
}


def make_drafter(kind, target, seed=1):
  """A random drafter; eagle's and medusa's draft from a shuffled subset of the vocabulary."""
  cfg = drafter_lib.DrafterConfig.for_target(kind, target.cfg, **SETTINGS[kind])
  vocab = None
  if cfg.draft_vocab_size:
    ids = jax.random.permutation(jax.random.key(seed + 1), cfg.vocab_size)
    vocab = ids[: cfg.draft_vocab_size].astype(np.int32)
  params = drafter_lib.init_params(cfg, jax.random.key(seed))
  return drafter_lib.Drafter(cfg=cfg, params=params, vocab=vocab)


def flat(params):
  return traverse_util.flatten_dict(jax.device_get(params), sep="/")


@pytest.mark.parametrize("kind", drafter_lib.KINDS)
def test_save_then_load_round_trips(target, tmp_path, kind):
  drafter = make_drafter(kind, target)
  drafter_files.save_drafter(str(tmp_path), drafter)
  loaded = drafter_files.load_drafter(str(tmp_path), target)
  assert loaded.cfg == drafter.cfg
  if drafter.vocab is None:
    assert loaded.vocab is None
  else:
    assert loaded.vocab.dtype == np.int32
    assert loaded.vocab.tolist() == drafter.vocab.tolist()
  original, restored = flat(drafter.params), flat(loaded.params)
  assert restored.keys() == original.keys()
  assert (len(original) == 0) == (kind == "pld")
  for name, value in original.items():
    assert restored[name].dtype == value.dtype, name
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  # Loaded for a target, a drafter with a draft vocabulary carries its head, gathered once: the
  # one `decode.generate` gathers in every call for a drafter without it.
  if drafter.vocab is None:
    assert loaded.head is None
  else:
    np.testing.assert_array_equal(loaded.head, drafter.with_head(target).head)
  # Greedy output is the target's whatever the drafter; rounds and acceptance are the drafter's.
  cfg = decode.DecodeConfig(max_new_tokens=12)
  tokens, lengths = testing.padded(testing.PROMPTS)
  want = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  got = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, loaded)
  for field in ("tokens", "lengths", "rounds", "accepted_per_depth"):
    assert getattr(got, field).tolist() == getattr(want, field).tolist(), field


def test_a_drafter_taken_to_another_layout_gathers_its_head_again(target):
  """The head is stored in the drafter's weight layout, so a drafter moved to another layout
  drops it (`decode.generate` gathers it in the new one) rather than keep one of the old."""
  drafter = make_drafter("eagle", target).with_head(target)
  moved = drafter.with_weight_layout("panels")
  assert drafter.head is not None and moved.head is None
  cfg = decode.DecodeConfig(max_new_tokens=12)
  tokens, lengths = testing.padded(testing.PROMPTS)
  want = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  got = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, moved.with_head(target))
  assert moved.with_head(target).head.shape != drafter.head.shape
  assert got.tokens.tolist() == want.tokens.tolist()


def test_save_then_load_through_epath(target, tmp_path):
  """A drafter directory given as an `etils.epath.Path` (what a gs:// URL becomes) is written
  and read back through epath."""
  directory = epath.Path(tmp_path) / "export"
  drafter = make_drafter("eagle", target)  # parameters and a draft vocabulary
  drafter_files.save_drafter(directory, drafter)
  loaded = drafter_files.load_drafter(directory, target)
  assert loaded.cfg == drafter.cfg
  assert loaded.vocab.tolist() == drafter.vocab.tolist()
  original, restored = flat(drafter.params), flat(loaded.params)
  assert restored.keys() == original.keys() and original
  for name, value in original.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_remote_parameters_are_read_through_a_local_copy(target, tmp_path):
  """A parameters file behind a URL (no local file to memory-map) reads as the local one."""
  drafter_files.save_drafter(str(tmp_path), make_drafter("eagle", target))
  local = epath.Path(tmp_path) / drafter_files.PARAMS_FILE

  class Remote:  # the part of an epath gs:// path the reader uses
    def __fspath__(self):
      return "gs://bucket/export/" + drafter_files.PARAMS_FILE

    def read_bytes(self):
      return local.read_bytes()

  want = drafter_files._read_tensors(local)
  got = drafter_files._read_tensors(Remote())
  assert got.keys() == want.keys() and want
  for name, value in want.items():
    assert got[name].dtype == value.dtype, name
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_json_records_kind_draft_length_tree_and_target(target, tmp_path):
  drafter_files.save_drafter(str(tmp_path), make_drafter("medusa", target), extra={"steps": 7})
  with open(tmp_path / drafter_files.CONFIG_FILE) as fh:
    config = json.load(fh)
  assert config["kind"] == "medusa"
  assert config["num_draft"] == 4
  assert config["tree"] == "sparse8"
  assert config["target"] == {"name": "tiny", "vocab_size": 16, "hidden_size": 32}
  assert config["steps"] == 7
  with open(tmp_path / drafter_files.PARAMS_FILE, "rb") as fh:
    assert fh.read(8)  # the params file exists and is not empty


def test_medusa_heads_stored_as_k_weights_load_as_one_dense_weight(target, tmp_path):
  drafter = make_drafter("medusa", target)
  drafter_files.save_drafter(str(tmp_path), drafter)
  tensors = load_file(str(tmp_path / drafter_files.PARAMS_FILE))
  heads = tensors.pop("heads")  # [D, K, D]: head d maps x to x @ heads[:, d]
  assert heads.shape == (32, 4, 32)
  # The older layout: K weights [K, D, D] under the name `w`.
  tensors["w"] = np.ascontiguousarray(np.swapaxes(heads, 0, 1))
  save_file(tensors, str(tmp_path / drafter_files.PARAMS_FILE))
  loaded = drafter_files.load_drafter(str(tmp_path), target)
  np.testing.assert_array_equal(flat(loaded.params)["heads"], flat(drafter.params)["heads"])
  x = jax.random.normal(jax.random.key(3), (2, 32))
  h = x @ tensors["w"][1] + flat(drafter.params)["b"][1]
  np.testing.assert_allclose(loaded.apply(x)[:, 1], x + jax.nn.silu(h), rtol=1e-5, atol=1e-6)


def test_decoding_takes_the_sampling_tree_above_temperature_zero(target, tmp_path):
  drafter_files.save_drafter(str(tmp_path), make_drafter("eagle", target))
  drafter = drafter_files.load_drafter(str(tmp_path), target)
  sampled = sampling.SamplingConfig(temperature=0.7)
  greedy_pool = decode.resolve_tree(decode.DecodeConfig(), drafter)
  sampled_pool = decode.resolve_tree(decode.DecodeConfig(sampling=sampled), drafter)
  assert greedy_pool == tree_specs.parse("dynamic:5", 3)
  assert sampled_pool == tree_specs.parse("chain", 3)
  # A tree asked for explicitly wins at any temperature; without a sampling tree, `tree` serves.
  explicit = decode.DecodeConfig(sampling=sampled, tree="sparse4")
  assert decode.resolve_tree(explicit, drafter) == tree_specs.parse("sparse4", 3)
  medusa = make_drafter("medusa", target)
  assert decode.resolve_tree(decode.DecodeConfig(sampling=sampled), medusa) == tree_specs.parse(
    "sparse8", 4
  )
  with pytest.raises(ValueError, match="tree"):
    medusa.cfg.replace(sampling_tree="bushy")


def test_the_adaptive_tree_takes_its_sampling_candidates_above_temperature_zero(target, tmp_path):
  drafter = make_drafter("eagle", target)
  drafter = drafter.replace(
    cfg=drafter.cfg.replace(adaptive="paths:0+lookup:3|chain", sampling_adaptive="paths:0|chain")
  )
  drafter_files.save_drafter(str(tmp_path), drafter)
  loaded = drafter_files.load_drafter(str(tmp_path), target)
  assert loaded.cfg.sampling_adaptive == "paths:0|chain"  # written and read back

  def pool(temperature):
    sampled = sampling.SamplingConfig(temperature=temperature)
    return decode.resolve_tree(decode.DecodeConfig(sampling=sampled, tree="adaptive"), loaded)

  assert pool(0.0) == tree_specs.parse("adaptive:paths:0+lookup:3|chain", 3)
  assert pool(0.7) == tree_specs.parse("adaptive:paths:0|chain", 3)
  # Without a sampling set, the greedy one serves at every temperature.
  plain = loaded.replace(cfg=loaded.cfg.replace(sampling_adaptive=""))
  sampled = decode.DecodeConfig(sampling=sampling.SamplingConfig(temperature=0.7), tree="adaptive")
  assert decode.resolve_tree(sampled, plain) == pool(0.0)
  with pytest.raises(ValueError, match="tree"):
    loaded.cfg.replace(sampling_adaptive="paths:0|bushy")


def test_trees_tuned_for_a_kind_of_device_are_taken_there(target, tmp_path):
  drafter_files.save_drafter(str(tmp_path), make_drafter("pspec", target))
  path = tmp_path / drafter_files.CONFIG_FILE
  config = json.loads(path.read_text())
  config["sampling_tree"] = "chain"
  config["device_trees"] = {
    "gpu": {"tree": "sparse16+lookup:6"},
    "tpu": {"sampling_tree": "lookup", "sampling_adaptive": "paths:0|chain"},
  }
  path.write_text(json.dumps(config))

  def trees(platform):
    cfg = drafter_files.read_drafter_config(str(tmp_path), target.cfg, platform)
    return cfg.tree, cfg.sampling_tree, cfg.sampling_adaptive

  assert trees("gpu") == ("sparse16+lookup:6", "chain", "")  # its entry, else the file's own
  assert trees("tpu") == ("sparse6", "lookup", "paths:0|chain")
  assert trees("cpu") == ("sparse6", "chain", "")  # no entry: the file's trees
  assert drafter_files.load_drafter(str(tmp_path), target).cfg.tree == "sparse6"  # on this CPU


def test_a_device_entry_can_make_the_adaptive_tree_the_default(target, tmp_path):
  """`default_tree`: a drafter decodes with its adaptive tree unless told otherwise where its
  file (or its device's entry) says so; `fixed` names its fixed tree for the temperature."""
  drafter_files.save_drafter(str(tmp_path), make_drafter("pspec", target))
  path = tmp_path / drafter_files.CONFIG_FILE
  config = json.loads(path.read_text())
  assert config["default_tree"] == "fixed"  # written
  config["sampling_tree"] = "chain"
  config["adaptive"] = "paths:0|paths:0+lookup:2"
  config["device_trees"] = {"cpu": {"default_tree": "adaptive"}}
  path.write_text(json.dumps(config))
  here = drafter_files.load_drafter(str(tmp_path), target)  # on this CPU
  elsewhere = drafter_files.read_drafter_config(str(tmp_path), target.cfg, "gpu")
  assert (here.cfg.default_tree, elsewhere.default_tree) == ("adaptive", "fixed")

  def pool(tree, temperature=0.0):
    sampled = sampling.SamplingConfig(temperature=temperature)
    return decode.resolve_tree(decode.DecodeConfig(tree=tree, sampling=sampled), here)

  assert pool("") == pool("adaptive") == tree_specs.parse("adaptive:paths:0|paths:0+lookup:2", 3)
  assert pool("fixed") == tree_specs.parse("sparse6", 3)
  assert pool("fixed", 0.7) == tree_specs.parse("chain", 3)
  assert pool("sparse4") == tree_specs.parse("sparse4", 3)
  assert here.cfg.tree_for(True) == "adaptive" and elsewhere.tree_for(True) == "sparse6"
  config["device_trees"] = {"cpu": {"default_tree": "dynamic"}}
  path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match="device_trees.cpu.default_tree must be one of fixed"):
    drafter_files.load_drafter(str(tmp_path), target)
  with pytest.raises(ValueError, match="default_tree must be one of fixed, adaptive"):
    here.cfg.replace(default_tree="sometimes")


def test_a_device_entry_decodes_from_the_first_tokens_of_the_draft_vocabulary(target, tmp_path):
  drafter = make_drafter("eagle", target)  # 11 stored token ids
  drafter_files.save_drafter(str(tmp_path), drafter)
  path = tmp_path / drafter_files.CONFIG_FILE
  config = json.loads(path.read_text())
  config["device_trees"] = {"cpu": {"draft_vocab_size": 4}}
  path.write_text(json.dumps(config))

  def size(platform, **kw):
    return drafter_files.read_drafter_config(str(tmp_path), target.cfg, platform, **kw)

  assert size("cpu").draft_vocab_size == 4
  assert size("gpu").draft_vocab_size == 11  # no entry there: the whole stored vocabulary
  assert size("cpu", as_stored=True).draft_vocab_size == 11
  loaded = drafter_files.load_drafter(str(tmp_path), target)  # on this CPU
  assert loaded.cfg.draft_vocab_size == 4
  assert loaded.vocab.tolist() == drafter.vocab[:4].tolist()
  cut = drafter.with_draft_vocab(4)
  assert cut.cfg == loaded.cfg and cut.vocab.tolist() == loaded.vocab.tolist()
  np.testing.assert_array_equal(loaded.head, cut.with_head(target).head)
  assert loaded.head.shape[0] == 4
  stored = drafter_files.load_drafter(str(tmp_path), target, as_stored=True)
  assert stored.cfg == drafter.cfg and stored.vocab.tolist() == drafter.vocab.tolist()
  # Still lossless, drafting from fewer tokens: its rounds are those of the drafter cut by hand.
  cfg = decode.DecodeConfig(max_new_tokens=12, tree="sparse6")
  tokens, lengths = testing.padded(testing.PROMPTS)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  got = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, loaded)
  by_hand = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, cut)
  assert got.tokens.tolist() == plain.tokens.tolist()
  assert got.rounds.tolist() == by_hand.rounds.tolist()
  assert got.accepted_per_depth.tolist() == by_hand.accepted_per_depth.tolist()
  assert drafter.with_draft_vocab(11) is drafter
  for bad in (0, 12):
    with pytest.raises(ValueError, match=r"draft vocabulary size must be in \[1, 11\]"):
      drafter.with_draft_vocab(bad)
  with pytest.raises(ValueError, match="no draft vocabulary"):
    make_drafter("pspec", target).with_draft_vocab(4)


@pytest.mark.parametrize("size", [0, 12, "4", 4.0, True])
def test_a_device_draft_vocabulary_beyond_the_stored_one_is_one_clear_error(target, tmp_path, size):
  drafter_files.save_drafter(str(tmp_path), make_drafter("eagle", target))
  path = tmp_path / drafter_files.CONFIG_FILE
  config = json.loads(path.read_text())
  config["device_trees"] = {"tpu": {"draft_vocab_size": size}}  # any device's entry is checked
  path.write_text(json.dumps(config))
  with pytest.raises(
    ValueError, match=r"device_trees.tpu.draft_vocab_size must be an .* \[1, 11\]"
  ):
    drafter_files.load_drafter(str(tmp_path), target)


def test_shipped_drafters_read_on_every_kind_of_device():
  from configs import smollm2_135m
  from train import build

  target = build.target_config(smollm2_135m.get_config())
  trees, vocab = {}, {}
  for kind in ("pspec", "eagle", "medusa"):
    directory = drafter_files.shipped_drafter(target.name, kind)
    for platform in ("cpu", "gpu", "tpu"):
      cfg = drafter_files.read_drafter_config(directory, target, platform)
      trees[kind, platform] = cfg.tree
      vocab[kind, platform] = cfg.draft_vocab_size
  # The README's: pspec's fastest greedy tree on the H100 was a 16-node one; on a CPU decoding
  # from the GGUF file's blocks, the lookup chain alone (drafted nodes no longer pay there); a
  # TPU has no entry and takes the file's own tree.
  assert trees["pspec", "gpu"] == "sparse16+lookup:6"
  assert trees["pspec", "cpu"] == "paths:0+lookup:6"
  assert trees["pspec", "tpu"] == "paths:0+lookup:6"
  # pspec and eagle decode on a CPU from the 4,096 most frequent of their 16,384 draft tokens:
  # a quarter of the LM head to read in each drafter pass.
  for kind in ("pspec", "eagle"):
    assert vocab[kind, "cpu"] == 4096
    assert vocab[kind, "gpu"] == vocab[kind, "tpu"] == 16384


# Greedy decoding of two chat prompts with each shipped drafter (format version 1, without the
# architecture options: eagle's and medusa's were written before they existed), tree sparse8,
# 24 new tokens: rounds and accepted drafts per depth, recorded with the code before those
# options existed (pspec's: when its GPU-trained weights shipped). They depend on every draft.
_CHAT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]
_CHAT += [407, 19712, 8182, 2, 198, 1, 4093, 198]
SHIPPED_PROMPTS = [
  _CHAT + [1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],  # capital of France?
  _CHAT + [19161, 253, 1890, 8216, 563, 260, 3426, 30, 2, 198, 1, 520, 9531, 198],  # a poem
]
SHIPPED_DECODES = {
  "pspec": dict(rounds=[15, 12], accepted=[[7, 1, 0, 0], [8, 3, 0, 0]]),
  "eagle": dict(rounds=[16, 12], accepted=[[6, 1, 0, 0], [9, 2, 0, 0]]),
  "medusa": dict(rounds=[21, 16], accepted=[[2, 0, 0, 0], [6, 1, 0, 0]]),
}


def test_old_drafter_files_load_and_decode_as_before(smollm2):
  target, _ = smollm2
  tokens, lengths = testing.padded(SHIPPED_PROMPTS, width=max(map(len, SHIPPED_PROMPTS)))
  cfg = decode.DecodeConfig(max_new_tokens=24, tree="sparse8")
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  for kind, want in SHIPPED_DECODES.items():
    directory = drafter_files.shipped_drafter(target.cfg.name, kind)
    config = json.loads((epath.Path(directory) / drafter_files.CONFIG_FILE).read_text())
    assert config["format_version"] == 1 and "num_layers" not in config
    # As stored: the decodes were recorded with the whole draft vocabulary, before a device
    # entry could cut it.
    drafter = drafter_files.load_drafter(directory, target, as_stored=True)
    assert (drafter.cfg.num_layers, drafter.cfg.feature_layers) == (1, ())
    assert drafter.cfg.mask_input == "per_depth"
    # Every stored tensor is a parameter: nothing in the file is left unread. (medusa's file
    # holds its heads as K weights `w` [K, D, D], read as the one dense weight `heads`.)
    stored = set(load_file(os.path.join(directory, drafter_files.PARAMS_FILE)))
    stored = {"heads" if name == "w" and kind == "medusa" else name for name in stored}
    assert stored - {drafter_files.VOCAB_TENSOR} == set(flat(drafter.params))
    out = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
    assert out.tokens.tolist() == plain.tokens.tolist()
    assert out.rounds.tolist() == want["rounds"], kind
    assert out.accepted_per_depth.tolist() == want["accepted"], kind


@pytest.mark.parametrize(
  "options",
  [
    dict(feature_layers=(1, 0)),
    dict(num_layers=2),
    dict(mask_input="shared"),
    dict(feature_layers=(0, 1), num_layers=3, mask_input="shared"),
  ],
)
def test_architecture_options_are_recorded_and_round_trip(target, tmp_path, options):
  drafter = drafter_lib.random_drafter("pspec", target, jax.random.key(2), num_draft=3, **options)
  drafter_files.save_drafter(str(tmp_path), drafter)
  config = json.loads((tmp_path / drafter_files.CONFIG_FILE).read_text())
  # Files with an option are version 2, which readers from before the options refuse.
  assert config["format_version"] == 2
  for name, value in options.items():
    assert config[name] == (list(value) if isinstance(value, tuple) else value)
  loaded = drafter_files.load_drafter(str(tmp_path), target)
  assert loaded.cfg == drafter.cfg
  original, restored = flat(drafter.params), flat(loaded.params)
  assert restored.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
  cfg = decode.DecodeConfig(max_new_tokens=12, tree="sparse6")
  tokens, lengths = testing.padded(testing.PROMPTS)
  want = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  got = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, loaded)
  for field in ("tokens", "rounds", "accepted_per_depth"):
    assert getattr(got, field).tolist() == getattr(want, field).tolist(), field


def test_a_default_drafter_is_written_as_before(target, tmp_path):
  drafter = drafter_lib.random_drafter("pspec", target, jax.random.key(2), num_draft=3)
  drafter_files.save_drafter(str(tmp_path), drafter)
  config = json.loads((tmp_path / drafter_files.CONFIG_FILE).read_text())
  assert config["format_version"] == 1
  assert not {"num_layers", "feature_layers", "mask_input"} & set(config)
  names = set(load_file(str(tmp_path / drafter_files.PARAMS_FILE)))
  assert names == set(flat(drafter.params))
  assert {name.split("/")[0] for name in names} == {"fuse", "block", "norm", "mask_slots"}


@pytest.mark.parametrize(
  "options,message",
  [
    (dict(kind="eagle", feature_layers=(0,)), "feature_layers is for pspec"),
    (dict(kind="medusa", num_layers=2), "num_layers"),
    (dict(kind="eagle", mask_input="shared"), "mask_input"),
    (dict(kind="pspec", mask_input="one"), "mask_input"),
    (dict(kind="pspec", feature_layers=(1, 1)), "distinct"),
  ],
)
def test_bad_architecture_options_are_one_clear_error(target, options, message):
  with pytest.raises(ValueError, match=message):
    drafter_lib.DrafterConfig.for_target(target=target.cfg, **options)


def test_feature_layers_beyond_the_target_are_one_clear_error(target):
  drafter = drafter_lib.random_drafter("pspec", target, jax.random.key(2), feature_layers=(2,))
  tokens, lengths = testing.padded(testing.PROMPTS)
  with pytest.raises(ValueError, match="feature layers"):
    decode.generate(target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(), drafter)


# --- bad files -------------------------------------------------------------------------------


@pytest.fixture
def saved(target, tmp_path):
  """A saved pspec drafter (K=4): its directory."""
  drafter = drafter_lib.random_drafter("pspec", target, jax.random.key(1), num_draft=4)
  drafter_files.save_drafter(str(tmp_path), drafter)
  return tmp_path


@pytest.mark.parametrize(
  "changes", [dict(name="other"), dict(vocab_size=24), dict(hidden_size=48, num_heads=6)]
)
def test_loading_for_another_target_is_refused(saved, changes):
  # Only the target's config is read: abstract parameters will do.
  cfg = testing.TINY.replace(**changes)
  other = llama.Target(
    cfg=cfg, params=jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
  )
  with pytest.raises(ValueError, match="built for target 'tiny'"):
    drafter_files.load_drafter(str(saved), other)


def test_missing_directory(target, tmp_path):
  with pytest.raises(ValueError, match="drafter not found"):
    drafter_files.load_drafter(str(tmp_path / "nowhere"), target)


@pytest.mark.parametrize("text", ['{"kind": "pspec", ', "[1, 2]", '{"kind": "pspec"}', ""])
def test_corrupt_json(saved, target, text):
  (saved / drafter_files.CONFIG_FILE).write_text(text)
  with pytest.raises(ValueError, match="corrupt drafter config"):
    drafter_files.load_drafter(str(saved), target)


def rewrite_params(directory, change):
  path = str(directory / drafter_files.PARAMS_FILE)
  tensors = load_file(path)
  change(tensors)
  save_file(tensors, path)


def test_wrong_shaped_tensor(saved, target):
  rewrite_params(saved, lambda t: t.update(fuse=np.zeros((64, 31), np.float32)))
  with pytest.raises(ValueError, match=r"tensor fuse should be \(64, 32\), found \(64, 31\)"):
    drafter_files.load_drafter(str(saved), target)


def test_missing_tensor(saved, target):
  rewrite_params(saved, lambda t: t.pop("block/attn/q"))
  with pytest.raises(ValueError, match="tensor block/attn/q should be .*, found nothing"):
    drafter_files.load_drafter(str(saved), target)


def test_draft_length_that_does_not_match_the_tensors(saved, target):
  # K=6 needs 5 mask vectors; the file holds the 3 of K=4.
  config = json.loads((saved / drafter_files.CONFIG_FILE).read_text())
  (saved / drafter_files.CONFIG_FILE).write_text(json.dumps(config | {"num_draft": 6}))
  with pytest.raises(ValueError, match=r"tensor mask_slots should be \(5, 32\), found \(3, 32\)"):
    drafter_files.load_drafter(str(saved), target)


@pytest.mark.parametrize(
  "ids", [[0, 1, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 16], [-1, 0, 1, 2, 3, 4, 5]]
)
def test_corrupt_draft_vocabulary(target, tmp_path, ids):
  drafter_files.save_drafter(str(tmp_path), make_drafter("medusa", target))
  rewrite_params(tmp_path, lambda t: t.update(draft_vocab=np.asarray(ids, np.int32)))
  with pytest.raises(ValueError, match="corrupt draft vocabulary"):
    drafter_files.load_drafter(str(tmp_path), target)


def test_truncated_safetensors(saved, target):
  path = saved / drafter_files.PARAMS_FILE
  data = path.read_bytes()
  for size in (len(data) - 100, 20, 4):  # tensor data, header, header length cut short
    path.write_bytes(data[:size])
    with pytest.raises(ValueError, match="corrupt safetensors"):
      drafter_files.load_drafter(str(saved), target)


# --- resolve_drafter -------------------------------------------------------------------------


def test_resolve_none_and_pld(target):
  assert drafter_files.resolve_drafter("none", None, target) is None
  pld = drafter_files.resolve_drafter("pld", None, target, num_draft=6)
  assert (pld.cfg.kind, pld.cfg.num_draft, pld.params) == ("pld", 6, {})
  assert pld.cfg.tree == "lookup"  # K lookup tokens, verified only in rounds with a match
  with pytest.raises(ValueError, match="unknown method 'beam'"):
    drafter_files.resolve_drafter("beam", None, target)


def test_drafter_source_checks_the_flags_without_loading(tmp_path):
  shipped = drafter_files.drafter_source("pspec", None, "smollm2-135m-instruct")
  assert shipped == drafter_files.shipped_drafter("smollm2-135m-instruct", "pspec")
  assert os.path.isfile(os.path.join(shipped, drafter_files.CONFIG_FILE))
  assert drafter_files.drafter_source("eagle", "random", "any") == "random"
  assert drafter_files.drafter_source("pld", None, "any") is None
  with pytest.raises(ValueError, match="drafter not found: .*drafter.json does not exist"):
    drafter_files.drafter_source("pspec", str(tmp_path), "any")
  with pytest.raises(ValueError, match="--method=none takes no --drafter"):
    drafter_files.drafter_source("none", str(tmp_path), "any")


@pytest.mark.parametrize("spec", [None, ""])
def test_resolve_needs_a_drafter(target, spec):
  with pytest.raises(ValueError, match="--method=pspec needs --drafter"):
    drafter_files.resolve_drafter("pspec", spec, target)


def test_resolve_random_is_seeded(target):
  def params(seed, kind="eagle"):
    drafter = drafter_files.resolve_drafter(kind, "random", target, seed=seed, num_draft=3)
    assert (drafter.cfg.kind, drafter.cfg.num_draft) == (kind, 3)
    return flat(drafter.params)

  first, again, other = params(0), params(0), params(1)
  for name in first:
    np.testing.assert_array_equal(first[name], again[name], err_msg=name)
  # Norm scales start at one whatever the seed; the random matrices differ.
  differs = {name for name in first if not np.array_equal(first[name], other[name])}
  assert {"fuse", "block/attn/q", "block/attn/o", "block/mlp/down"} <= differs
  # Another kind from the same seed has its own parameters.
  assert params(0, "pspec").keys() == first.keys() | {"mask_slots"}


def test_resolve_a_saved_drafter_checks_its_kind(target, tmp_path):
  eagle = make_drafter("eagle", target)
  drafter_files.save_drafter(str(tmp_path), eagle)
  loaded = drafter_files.resolve_drafter("eagle", str(tmp_path), target, num_draft=7)
  assert loaded.cfg == eagle.cfg  # a saved drafter keeps its own K
  with pytest.raises(ValueError, match="is a eagle drafter, not pspec"):
    drafter_files.resolve_drafter("pspec", str(tmp_path), target)


@pytest.mark.parametrize(
  "edit",
  [
    lambda c: c.update(target=5),
    lambda c: c["layer"].update(rope_scaling={"factor": 8.0}),
    lambda c: c["layer"].update(num_heads="four"),
    lambda c: c.update(num_draft="x"),
    lambda c: c.update(device_trees={"cpu": {"tree": "bushy"}}),
    lambda c: c.update(device_trees={"gpu": {"sampling_tree": "bushy"}}),  # not this device's
    lambda c: c.update(device_trees={"tpu": {"sampling_adaptive": "chain|bushy"}}),
    lambda c: c.update(sampling_adaptive="adaptive"),
    lambda c: c.update(device_trees={"cpu": {"tree_for_gpu": "chain"}}),
    lambda c: c.update(device_trees={"gpu": "chain"}),
    lambda c: c.update(device_trees=["cpu"]),
    # pspec here drafts from the whole vocabulary: there is no stored one to cut.
    lambda c: c.update(device_trees={"cpu": {"draft_vocab_size": 4}}),
  ],
)
def test_corrupt_fields_are_one_clear_error(target, tmp_path, edit):
  drafter_files.save_drafter(
    str(tmp_path), drafter_lib.random_drafter("pspec", target, jax.random.key(1))
  )
  path = tmp_path / "drafter.json"
  config = json.loads(path.read_text())
  edit(config)
  path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match="corrupt drafter config"):
    drafter_files.load_drafter(str(tmp_path), target)


def test_newer_format_and_a_drafter_for_pld_are_errors(target, tmp_path):
  drafter_files.save_drafter(
    str(tmp_path), drafter_lib.random_drafter("medusa", target, jax.random.key(1))
  )
  path = tmp_path / "drafter.json"
  path.write_text(json.dumps(json.loads(path.read_text()) | {"format_version": 99}))
  with pytest.raises(ValueError, match="format version 99"):
    drafter_files.load_drafter(str(tmp_path), target)
  with pytest.raises(ValueError, match="--method=pld takes no --drafter"):
    drafter_files.resolve_drafter("pld", str(tmp_path), target)


def test_export_to_an_object_store_url(target, tmp_path):
  """A gs:// export directory is written through epath (the store is mocked by a local dir)."""
  from etils import epath
  from etils.epath import testing

  def local(path):
    return str(path).replace("gs://bucket", str(tmp_path))

  def redirect(fn, path, *args, **kwargs):
    return fn(local(path), *args, **kwargs)

  mocks = {name: redirect for name in ("open", "makedirs", "mkdir", "exists", "isdir")}
  drafter = make_drafter("eagle", target)
  with testing.mock_epath(**mocks):
    drafter_files.save_drafter(epath.Path("gs://bucket/run/export"), drafter)
  loaded = drafter_files.load_drafter(str(tmp_path / "run" / "export"), target)
  assert loaded.cfg == drafter.cfg
