"""The sharded train step: the same loss and update on 8 fake CPU devices as on one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import drafter as drafter_lib
from pspec_jax import losses, sharding, testing
from train import step as step_lib


def _batch(batch=8, length=16):
  tokens = jax.random.randint(jax.random.key(5), (batch, length), 0, testing.TINY.vocab_size)
  loss_mask = jnp.arange(length)[None, :] >= jnp.arange(batch)[:, None] % 5 + 2
  segments = jnp.where(jnp.arange(length) < length // 2, 1, 2) * jnp.ones((batch, 1), jnp.int32)
  return {"tokens": tokens.astype(jnp.int32), "loss_mask": loss_mask, "segments": segments}


def _one_step(kind, mesh, options=None, loss_options=None):
  target = testing.make_target(3.0).with_scan_layers(True)
  drafter = drafter_lib.random_drafter(
    kind, target, jax.random.key(0), num_draft=3, **(options or {})
  )
  cfg = step_lib.StepConfig(
    target=target.cfg,
    drafter=drafter.cfg,
    loss=losses.LossConfig(anchors=4, chunk=32, feature_weight=0.5, **(loss_options or {})),
    optimizer=step_lib.OptimizerConfig(lr=1e-2, warmup_steps=1, steps=10),
  )
  place = step_lib.placement(cfg, mesh)
  state = jax.device_put(step_lib.init_state(cfg, drafter.params), place.state)
  target_params = jax.device_put(target.params, place.target)
  batch = jax.device_put(_batch(), place.batch)
  state, metrics = step_lib.jit_train_step(cfg, place)(
    state, target_params, batch, jax.random.key(1)
  )
  return jax.device_get((state.params, metrics)), state


MESHES = [dict(data=8), dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=4, tensor=2)]


# (kind, drafter options, loss options, meshes): today's drafters on every mesh, then the new
# options together on the mesh that splits every axis.
SHARDED_CASES = [
  ("pspec", {}, {}, MESHES),
  ("eagle", {}, {}, MESHES),
  ("medusa", {}, {}, MESHES),
  ("pspec", dict(feature_layers=(1, 0), num_layers=2, mask_input="shared"), {}, MESHES[1:2]),
  ("pspec", dict(feature_layers=(1,)), dict(keep_ratio=0.6, keep_floor=0.3), MESHES[1:2]),
  ("eagle", dict(num_layers=2), {}, MESHES[1:2]),
]


@pytest.mark.parametrize(("kind", "options", "loss_options", "meshes"), SHARDED_CASES)
def test_sharded_step_equals_one_device(kind, options, loss_options, meshes):
  assert jax.device_count() == 8
  one = sharding.make_mesh(devices=jax.devices()[:1])
  (want_params, want_metrics), _ = _one_step(kind, one, options, loss_options)
  for shape in meshes:
    mesh = sharding.make_mesh(**shape)
    (params, metrics), state = _one_step(kind, mesh, options, loss_options)
    # A KL near 0 is a difference of O(1) terms: float32 rounding is absolute, ~1e-7.
    loss, want_loss = float(metrics["loss"]), float(want_metrics["loss"])
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(metrics["agree_per_depth"], want_metrics["agree_per_depth"])
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, want_params
    )
    # The updated state really lives on the mesh, sharded as the rules say.
    leaves = jax.tree.leaves(state.params)
    assert all(x.sharding.mesh.shape == mesh.shape for x in leaves)
    if shape.get("tensor", 1) > 1 and kind != "medusa":
      mlp = state.params["block"]["mlp"]["gate"]
      assert mlp.sharding.spec[-1] is not None  # MLP width split over `tensor`


def test_microbatches_average_the_parts():
  target = testing.make_target(3.0).with_scan_layers(True)
  drafter = drafter_lib.random_drafter("medusa", target, jax.random.key(0), num_draft=3)

  def config(microbatches):
    return step_lib.StepConfig(
      target=target.cfg,
      drafter=drafter.cfg,
      loss=losses.LossConfig(chunk=32),
      optimizer=step_lib.OptimizerConfig(lr=1e-2, warmup_steps=1, steps=10),
      microbatches=microbatches,
    )

  batch, key = _batch(), jax.random.key(1)
  state = step_lib.init_state(config(2), drafter.params)
  _, metrics = step_lib.train_step(state, target.params, batch, key, cfg=config(2))
  # Part j holds rows j, j + 2, ... (each device keeps its own rows).
  parts = [jax.tree.map(lambda x, j=j: x[j::2], batch) for j in range(2)]
  fresh = step_lib.init_state(config(1), drafter.params)
  evals = [step_lib.eval_step(fresh, target.params, p, key, cfg=config(1)) for p in parts]
  assert float(metrics["loss"]) == pytest.approx(
    np.mean([float(e["loss"]) for e in evals]), rel=1e-4
  )
  assert float(metrics["tokens"]) == sum(float(e["tokens"]) for e in evals)
  whole = step_lib.eval_step(fresh, target.params, batch, key, cfg=config(1))
  np.testing.assert_allclose(
    metrics["agree_per_depth"], whole["agree_per_depth"], rtol=1e-6
  )  # counts add up exactly


@pytest.mark.parametrize(
  ("kind", "options"), [("pspec", {}), ("medusa", {}), ("pspec", dict(feature_layers=(1, 0)))]
)
def test_precomputed_target_features_give_the_same_step(kind, options, tmp_path):
  from pspec_jax import data
  from train import features

  target = testing.make_target(3.0).with_scan_layers(True)
  drafter = drafter_lib.random_drafter(kind, target, jax.random.key(0), num_draft=3, **options)
  cfg = step_lib.StepConfig(
    target=target.cfg,
    drafter=drafter.cfg,
    loss=losses.LossConfig(anchors=4, chunk=32),
    optimizer=step_lib.OptimizerConfig(lr=1e-2, warmup_steps=1, steps=10),
  )
  cached = dataclasses.replace(cfg, cached_features=True)
  assert step_lib.batch_keys(cached) == step_lib.BATCH_KEYS + ("features",)
  rows = data.TokenData(**{k: np.asarray(v) for k, v in _batch(batch=5).items()})
  layers = drafter.cfg.feature_layers
  stored = features.target_features(rows, target, str(tmp_path), 2, layers)  # wraps
  # The final features, then (feature layers) the hidden states the drafter reads.
  assert stored.shape == (5, 16, testing.TINY.hidden_size * (1 + len(layers)))
  assert stored.shape[-1] == step_lib.abstract_batch(cached, 4, 16)["features"].shape[-1]
  again = features.target_features(rows, target, str(tmp_path), 8, layers)  # read back
  assert len(list(tmp_path.iterdir())) == 1 and np.array_equal(again, stored)
  batch = dataclasses.replace(rows, features=stored).batch(0, 4, seed=3)
  state = step_lib.init_state(cfg, drafter.params)
  key = jax.random.key(1)
  want_state, want = step_lib.train_step(
    state, target.params, rows.batch(0, 4, seed=3), key, cfg=cfg
  )
  got_state, got = step_lib.train_step(state, target.params, batch, key, cfg=cached)
  assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
    got_state.params,
    want_state.params,
  )


def test_a_draft_vocabulary_of_another_size_is_one_clear_error():
  """A run starting from a drafter file must train the vocabulary its config says, not one cut
  for decoding (`Drafter.with_draft_vocab`)."""
  target = testing.make_target(3.0)
  drafter = drafter_lib.random_drafter(
    "eagle", target, jax.random.key(0), num_draft=3, draft_vocab_size=12
  )
  cfg = step_lib.StepConfig(
    target=target.cfg,
    drafter=drafter.cfg,
    loss=losses.LossConfig(chunk=32),
    optimizer=step_lib.OptimizerConfig(lr=1e-2, warmup_steps=1, steps=10),
  )
  assert step_lib.init_state(cfg, drafter.params, drafter.vocab).draft_vocab.shape == (12,)
  cut = drafter.with_draft_vocab(5).vocab
  with pytest.raises(ValueError, match="needs a draft vocabulary of 12 tokens, got 5 tokens"):
    step_lib.init_state(cfg, drafter.params, cut)
  with pytest.raises(ValueError, match="needs a draft vocabulary of 12 tokens, got none"):
    step_lib.init_state(cfg, drafter.params)
