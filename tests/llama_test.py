"""The Flax target against HF transformers' PyTorch Llama, and its cache/tree invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec

from pspec_jax import checkpoints, layers, llama, sharding, testing, weights


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model.float()(torch.from_numpy(tokens).long()).logits.numpy()


def full_forward_logits(target, tokens_BT):
  positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  features, _ = target(jnp.asarray(tokens_BT), positions)
  return np.asarray(target.logits(features))


@pytest.mark.parametrize("name", sorted(testing.HF_CONFIGS))
def test_logits_match_hf_transformers(tmp_path, name):
  model = testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS[name])
  target = checkpoints.load_target(str(tmp_path))
  tokens = np.random.default_rng(0).integers(0, 96, (2, 40))
  ref = hf_logits(model, tokens)
  ours = full_forward_logits(target, tokens)
  assert np.abs(ref).max() > 1.0  # a meaningful comparison, not two near-zero arrays
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["mha_tied", "gqa_untied"])
def test_untie_head_gives_the_same_model_with_its_own_lm_head(tmp_path, name):
  model = testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS[name])
  target = checkpoints.load_target(str(tmp_path), scan_layers=False, untie_head=True)
  assert not target.cfg.tie_embeddings
  if name == "mha_tied":  # a copy of the embedding, in the [D, V] layout of an untied head
    np.testing.assert_array_equal(target.params["lm_head"], target.params["embedding"].T)
  tokens = np.random.default_rng(3).integers(0, 96, (2, 20))
  np.testing.assert_allclose(
    full_forward_logits(target, tokens), hf_logits(model, tokens), atol=1e-4, rtol=0
  )
  tied = checkpoints.load_target(str(tmp_path))
  ids = jnp.array([5, 0, 77])
  np.testing.assert_array_equal(target.head_rows(ids), tied.head_rows(ids))


def test_the_decode_layout_loads_per_layer_weights_and_an_untied_head(tmp_path):
  testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS["mha_tied"])
  layout = checkpoints.decode_layout()
  decoding = checkpoints.load_target(str(tmp_path), weight_layout="decode")
  assert not decoding.cfg.scan_layers and not decoding.cfg.tie_embeddings
  assert decoding.cfg.weight_layout == layout
  training = checkpoints.load_target(str(tmp_path))
  assert training.cfg.scan_layers and training.cfg.tie_embeddings
  assert training.cfg.weight_layout == "plain"
  # Either choice can be overridden.
  scanned = checkpoints.load_target(
    str(tmp_path), weight_layout="decode", scan_layers=True, untie_head=False
  )
  assert scanned.cfg.scan_layers and scanned.cfg.tie_embeddings
  assert scanned.cfg.weight_layout == layout
  tokens = np.random.default_rng(4).integers(0, 96, (1, 12))
  np.testing.assert_allclose(
    full_forward_logits(decoding, tokens), full_forward_logits(training, tokens), atol=1e-5, rtol=0
  )


def test_bfloat16_checkpoint_loads(tmp_path):
  testing.save_hf_llama(tmp_path, dtype=torch.bfloat16, **testing.HF_CONFIGS["gqa_untied"])
  target = checkpoints.load_target(str(tmp_path))
  tokens = np.random.default_rng(1).integers(0, 96, (1, 12))
  # Same bf16 weights, both computed in float32 (reloading keeps HF's RoPE buffer in float32).
  model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
  np.testing.assert_allclose(
    full_forward_logits(target, tokens), hf_logits(model, tokens), atol=1e-4, rtol=0
  )


def test_sharded_checkpoint_with_index_loads(tmp_path):
  model = testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS["gqa_untied"])
  model.save_pretrained(tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  (tmp_path / "model.safetensors").unlink(missing_ok=True)
  target = checkpoints.load_target(str(tmp_path))
  tokens = np.random.default_rng(2).integers(0, 96, (1, 12))
  np.testing.assert_allclose(
    full_forward_logits(target, tokens), hf_logits(model, tokens), atol=1e-4, rtol=0
  )


@pytest.mark.parametrize("scan_layers", [False, True])
def test_sharded_checkpoint_loads_straight_into_a_mesh(tmp_path, scan_layers):
  """Llama-2 architecture (MHA, untied) in several safetensors files, onto data=2 x tensor=4."""
  testing.save_hf_llama(
    tmp_path, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False
  )
  transformers.LlamaForCausalLM.from_pretrained(tmp_path).save_pretrained(
    tmp_path, max_shard_size="40KB"
  )
  (tmp_path / "model.safetensors").unlink(missing_ok=True)
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  mesh = sharding.make_mesh(data=2, tensor=4)
  whole = checkpoints.load_target(str(tmp_path), scan_layers=scan_layers)
  split = checkpoints.load_target(str(tmp_path), scan_layers=scan_layers, mesh=mesh)
  q = split.params["layers"]["attn"]["q"] if scan_layers else split.params["layers_0"]["attn"]["q"]
  assert q.sharding.spec == PartitionSpec(*([None] * scan_layers), None, "tensor", None)
  assert q.addressable_shards[0].data.shape[-2] == 1  # 4 heads over tensor=4
  assert split.params["lm_head"].sharding.spec == PartitionSpec(None, "tensor")
  tokens = np.random.default_rng(3).integers(0, 96, (2, 12))
  np.testing.assert_allclose(
    full_forward_logits(split, tokens), full_forward_logits(whole, tokens), atol=1e-5, rtol=0
  )


def test_rope_inv_freq_matches_hf_llama3():
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf_cfg = transformers.LlamaConfig(
    hidden_size=64,
    num_attention_heads=2,
    **{
      k: v
      for k, v in testing.HF_CONFIGS["llama3_scaling_wide_heads"].items()
      if k.startswith("rope")
    },
  )
  ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
  ours = layers.rope_inv_freq(
    weights.config_from_hf(
      hf_cfg.to_dict()
      | {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
      },
      "x",
    )
  )
  np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


TINY = llama.LlamaConfig(
  vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2
)


@pytest.fixture(scope="module")
def tiny_target():
  params = llama.init_params(TINY, jax.random.key(0))
  # Larger weights than the init so that attention patterns actually matter.
  params = jax.tree.map(lambda x: x * 5 if x.ndim > 2 else x, params)
  return llama.Target(cfg=TINY, params=params)


def test_cached_decode_equals_full_forward(tiny_target):
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  full, _ = tiny_target(tokens, positions)
  # Prefill 5 tokens, then one token, then a chunk of 6 tokens, through the cache.
  cache = tiny_target.empty_cache(batch=2, max_len=16)
  pieces = []
  for lo, hi in [(0, 5), (5, 6), (6, 12)]:
    features, kv = tiny_target(tokens[:, lo:hi], positions[:, lo:hi], cache if lo else None)
    cache = cache.write(kv, jnp.full((2,), hi - lo))
    pieces.append(features)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5)
  assert cache.lengths.tolist() == [12, 12]


def test_ragged_cache_lengths_per_sequence(tiny_target):
  """Sequence b attends to exactly its own cache.lengths[b] slots."""
  tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, TINY.vocab_size)
  lengths = jnp.array([3, 7])
  cache = tiny_target.empty_cache(batch=2, max_len=12)
  _, kv = tiny_target(tokens[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)))
  cache = cache.write(kv, lengths)  # slots past each length hold junk that must be ignored
  nxt = jnp.stack([tokens[0, 3], tokens[1, 7]])[:, None]
  features, _ = tiny_target(nxt, lengths[:, None], cache)
  for b, n in enumerate([3, 7]):
    alone, _ = tiny_target(tokens[b : b + 1, : n + 1], jnp.arange(n + 1)[None])
    np.testing.assert_allclose(features[b, 0], alone[0, -1], atol=1e-5)


def test_tree_mask_verification_equals_path_forwards(tiny_target):
  """Tree nodes with a node mask and per-node positions == running each path on its own."""
  prefix = jax.random.randint(jax.random.key(3), (1, 6), 0, TINY.vocab_size)
  cache = tiny_target.empty_cache(batch=1, max_len=16)
  _, kv = tiny_target(prefix, jnp.arange(6)[None])
  cache = cache.write(kv, jnp.array([6]))
  # Tree: root r; children a, b of r; child c of a.  Nodes in order [r, a, b, c].
  nodes = jnp.array([[10, 11, 12, 13]])
  parents = [-1, 0, 0, 1]
  depth = jnp.array([[0, 1, 1, 2]])
  mask = np.eye(4, dtype=bool)
  for i, p in enumerate(parents):
    while p >= 0:
      mask[i, p], p = True, parents[p]
  features, _ = tiny_target(nodes, 6 + depth, cache, jnp.asarray(mask))
  for path in ([0, 1, 3], [0, 2]):
    seq = jnp.concatenate([prefix, nodes[:, path]], axis=1)
    alone, _ = tiny_target(seq, jnp.arange(seq.shape[1])[None])
    np.testing.assert_allclose(features[0, jnp.array(path)], alone[0, 6:], atol=1e-5)


def test_config_rejects_bad_fields():
  with pytest.raises(ValueError, match="num_kv_heads"):
    llama.LlamaConfig(
      vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=3
    )
  with pytest.raises(ValueError, match="vocab_size"):
    llama.LlamaConfig(
      vocab_size=0, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2
    )


def test_looped_layers_equal_scanned_layers(tiny_target, tmp_path):
  looped = tiny_target.with_scan_layers(False)
  assert "layers_1" in looped.params and "layers" not in looped.params
  tokens = jax.random.randint(jax.random.key(4), (2, 7), 0, TINY.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  cache = tiny_target.empty_cache(batch=2, max_len=10)
  cache = cache.write(tiny_target(tokens[:, :3], positions[:, :3])[1], jnp.array([3, 3]))
  expected, expected_kv = tiny_target(tokens[:, 3:], positions[:, 3:], cache)
  features, kv = looped(tokens[:, 3:], positions[:, 3:], cache)
  np.testing.assert_allclose(features, expected, atol=1e-5)
  np.testing.assert_allclose(kv[0], expected_kv[0], atol=1e-5)
  assert looped.with_scan_layers(True).params["layers"]["attn"]["q"].shape == (2, 32, 4, 8)
  # The loader builds either layout directly.
  testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS["gqa_untied"])
  a = checkpoints.load_target(str(tmp_path))
  b = checkpoints.load_target(str(tmp_path), scan_layers=False)
  np.testing.assert_allclose(
    full_forward_logits(a, tokens), full_forward_logits(b, tokens), atol=1e-5
  )


@pytest.mark.parametrize("scan", [False, True])
def test_tapped_hidden_states_are_the_layers_outputs_from_the_same_pass(scan):
  """`taps` adds the residual stream after those layers (a layer-by-layer loop here), in the
  order asked, without changing the features or keys/values of the pass."""
  cfg = testing.TINY.replace(num_layers=4)
  target = testing.make_target(2.0, cfg=cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((9, 9), jnp.bool_)), (2, 9, 9))
  x = target.params["embedding"][tokens]
  outputs = []
  for i in range(cfg.num_layers):
    block = llama.Block(cfg)
    x, _ = block.apply({"params": target.params[f"layers_{i}"]}, x, None, positions, causal, None)
    outputs.append(x)
  plain_features, plain_kv = target(tokens, positions)
  model = target.with_scan_layers(scan)
  features, kv, hidden = model(tokens, positions, taps=(3, 0, 2))
  np.testing.assert_allclose(
    hidden, jnp.concatenate([outputs[i] for i in (3, 0, 2)], -1), atol=1e-5
  )
  np.testing.assert_allclose(features, plain_features, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), kv, plain_kv)
  with pytest.raises(ValueError, match="feature layers"):
    model(tokens, positions, taps=(4,))
