"""Decoding with parameters, batch and caches sharded over a mesh of 8 (fake) devices."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pspec_jax import decode, sharding, testing

# Widths that every mesh axis divides, so heads, MLP and vocabulary are really split.
WIDE = testing.TINY.replace(
  name="wide", vocab_size=64, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4
)


@pytest.fixture(scope="module")
def target():
  return testing.make_target(4.0, cfg=WIDE)


@pytest.mark.parametrize("mesh_shape", [dict(data=1, tensor=8), dict(data=2, tensor=4)])
@pytest.mark.parametrize(
  "kind,tree",
  [(None, ""), ("pspec", ""), ("pspec", "paths:0+min:0.07+lookup:4"), ("pspec", "adaptive")],
)
def test_sharded_greedy_decoding_gives_the_single_device_tokens(target, mesh_shape, kind, tree):
  drafter = None if kind is None else testing.drafter_for(kind, target, num_draft=3)
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=20, num_draft=3 if kind else 0, tree=tree)
  key = jax.random.key(0)
  single = jax.device_get(decode.generate(target, tokens, lengths, key, cfg, drafter))

  mesh = sharding.make_mesh(**mesh_shape)
  sharded_target, sharded_drafter = decode.shard(mesh, target, drafter)
  q = sharded_target.params["layers_0"]["attn"]["q"]
  assert q.sharding.spec == PartitionSpec(None, "tensor", None)
  mesh_cfg = decode.DecodeConfig(
    max_new_tokens=20, num_draft=3 if kind else 0, tree=tree, mesh=mesh
  )
  out = jax.device_get(
    decode.generate(sharded_target, tokens, lengths, key, mesh_cfg, sharded_drafter)
  )
  np.testing.assert_array_equal(out.tokens, single.tokens)
  np.testing.assert_array_equal(out.lengths, single.lengths)
  np.testing.assert_array_equal(out.rounds, single.rounds)
  np.testing.assert_array_equal(out.accepted_per_depth, single.accepted_per_depth)

  # The cache lives split over batch (data) and kv heads (tensor, when it divides them).
  plan = decode.make_plan(mesh_cfg, sharded_drafter, tokens.shape[1])
  state = decode.init(plan, sharded_target, sharded_drafter, tokens, lengths, key)
  data = "data" if mesh_shape["data"] > 1 else None
  heads = "tensor" if WIDE.num_kv_heads % mesh_shape["tensor"] == 0 else None
  spec = (None, data, None, heads, None)  # layers, batch, slots, kv heads, head dim
  for x in jax.tree.leaves((state.cache.k, state.cache.v)):  # per layer, or stacked
    expected = NamedSharding(mesh, PartitionSpec(*spec[-x.ndim :]))
    assert x.sharding.is_equivalent_to(expected, x.ndim)
