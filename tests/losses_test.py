"""Training layouts and losses against slow references written from DESIGN.md section 2."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY, make_target

from pspec_jax import drafter as drafter_lib
from pspec_jax import losses
from train import step as step_lib

S = 12  # sequence length of the layout tests


def _loss_mask(batch, seed):
  """Prompt then answer per row (answers start at varied places, some rows end early)."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((batch, S), bool)
  for row in range(batch):
    start, end = sorted(rng.choice(np.arange(1, S + 1), 2, replace=False))
    mask[row, start:end] = True
  return mask


def _reference_layout(anchors, num_slots, loss_mask):
  """Per slot (b, i, d): position, teacher index, weight, and the keys it may see, by loops.

  Keys are numbered as in one flat sequence: real pairs 0..S-1, then group i's slots at
  S + i * num_slots + (d - 1).
  """
  b, a = anchors.shape
  position = np.zeros((b, a, num_slots), int)
  teacher = np.zeros_like(position)
  weight = np.zeros(position.shape, np.float32)
  visible = np.zeros((b, S + a * num_slots, S + a * num_slots), bool)
  for row in range(b):
    for t in range(S):
      for u in range(S):
        visible[row, t, u] = u <= t  # real pairs: causal among themselves, never slots
    for i in range(a):
      anchor = anchors[row, i]
      for d in range(1, num_slots + 1):
        me = S + i * num_slots + d - 1
        position[row, i, d - 1] = anchor + d
        predicts = anchor + d + 2  # slot (a, d) predicts x[a + d + 2] ...
        teacher[row, i, d - 1] = min(predicts - 1, S - 1)  # ... distilled from p_{a+d+1}
        weight[row, i, d - 1] = loss_mask[row, predicts] if predicts < S else 0.0
        for u in range(S):
          visible[row, me, u] = u <= anchor  # real pairs with position <= a
        for e in range(1, d + 1):
          visible[row, me, S + i * num_slots + e - 1] = True  # own group, d' <= d
  return position, teacher, weight, visible


@pytest.mark.parametrize(("num_draft", "num_anchors"), [(2, 0), (4, 5), (5, S), (3, 1)])
def test_slot_layout_matches_the_reference(num_draft, num_anchors):
  loss_mask = _loss_mask(3, seed=num_draft)
  layout = losses.slot_layout(
    jnp.asarray(loss_mask), num_draft - 1, num_anchors, jax.random.key(num_anchors)
  )
  anchors = np.asarray(layout.anchors)
  a = num_anchors or S
  assert anchors.shape == (3, a)
  for row in range(3):
    assert len(set(anchors[row])) == a  # drawn without replacement
    # Anchors whose first slot is trained come first: all of them when there are enough.
    useful = {t for t in range(S - 3) if loss_mask[row, t + 3]}
    assert len(useful & set(anchors[row])) == min(len(useful), a)
  position, teacher, weight, _ = _reference_layout(anchors, num_draft - 1, loss_mask)
  np.testing.assert_array_equal(layout.positions, position)
  np.testing.assert_array_equal(layout.teacher, teacher)
  np.testing.assert_array_equal(layout.weight, weight)
  np.testing.assert_array_equal(layout.visible, anchors + 1)


def _flat_forward(module, embeds, features, positions, mask):
  """The drafter over one flat sequence (pairs, then every group's slots) and a full mask."""
  u = module.pairs(embeds, features)
  b, a, p = positions.shape[0], *positions.shape[1:]
  slots = jnp.broadcast_to(module.slots()[:p], (b, a, p, u.shape[-1])).reshape(b, a * p, -1)
  flat_positions = jnp.concatenate(
    [jnp.broadcast_to(jnp.arange(S), (b, S)), positions.reshape(b, -1)], axis=1
  )
  out, _ = module.block(jnp.concatenate([u, slots], 1), None, flat_positions, mask, None)
  return module.norm(out)


@pytest.mark.parametrize(("num_draft", "num_anchors"), [(2, 0), (4, 5), (5, S)])
def test_grouped_attention_equals_the_full_parallel_group_mask(num_draft, num_anchors):
  target = make_target(2.0)
  drafter = drafter_lib.random_drafter("pspec", target, jax.random.key(3), num_draft=num_draft)
  loss_mask = _loss_mask(2, seed=7)
  tokens = jax.random.randint(jax.random.key(1), (2, S), 0, TINY.vocab_size)
  layout = losses.slot_layout(jnp.asarray(loss_mask), num_draft - 1, num_anchors, jax.random.key(2))
  embeds = target.embed(losses.shifted(tokens, 1))
  features, _ = target(tokens, jnp.broadcast_to(jnp.arange(S), (2, S)))
  g_real, g_slots = drafter.apply(
    embeds, features, layout, method=drafter_lib.FeatureDrafter.train_forward
  )
  _, _, _, visible = _reference_layout(np.asarray(layout.anchors), num_draft - 1, loss_mask)
  flat = drafter.apply(
    embeds, features, layout.positions, jnp.asarray(visible), method=_flat_forward
  )
  np.testing.assert_allclose(g_real, flat[:, :S], atol=1e-5)
  np.testing.assert_allclose(g_slots.reshape(2, -1, TINY.hidden_size), flat[:, S:], atol=1e-5)


def _reference_rows(kind, num_draft, loss_mask):
  """(teacher index, weight, depth) of every row a kind trains, by loops."""
  rows = []
  for row in range(loss_mask.shape[0]):
    for t in range(S):
      depths = range(1, num_draft + 1) if kind == "medusa" else [1]
      for d in depths:
        predicts = t + d + 1  # pair t / medusa head d at t predicts x[t + d + 1]
        weight = loss_mask[row, predicts] if predicts < S else 0.0
        rows.append((row, min(predicts - 1, S - 1), weight, d))
  return rows


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_rows_of_eagle_and_medusa_match_the_reference(kind):
  target = make_target(2.0)
  drafter = drafter_lib.random_drafter(kind, target, jax.random.key(3), num_draft=3)
  loss_mask = _loss_mask(2, seed=11)
  tokens = jax.random.randint(jax.random.key(1), (2, S), 0, TINY.vocab_size)
  rows, _ = losses.distill_rows(
    drafter, target, tokens, jnp.asarray(loss_mask), jax.random.key(0), losses.LossConfig()
  )
  features, _ = target(tokens, jnp.broadcast_to(jnp.arange(S), (2, S)))
  reference = _reference_rows(kind, 3, loss_mask)
  assert rows.weight.size == len(reference)
  # Rows with a loss: same depths and teachers (rows without one may carry any teacher).
  kept = np.asarray(rows.weight) > 0
  got = sorted(
    zip(
      np.asarray(rows.depth)[kept].tolist(),
      np.asarray(rows.teacher)[kept].round(5).tolist(),
      strict=True,
    )
  )
  want = sorted((d, np.asarray(features[b, t]).round(5).tolist()) for b, t, w, d in reference if w)
  assert got == want
  np.testing.assert_array_equal(np.asarray(rows.weight)[kept], 1.0)


@pytest.mark.parametrize("name", losses.DIVERGENCES)
def test_divergences_against_numpy(name):
  rng = np.random.default_rng(0)
  draft, teacher = rng.normal(size=(2, 5, 7)) * 2
  p = np.exp(teacher / 1.5) / np.exp(teacher / 1.5).sum(-1, keepdims=True)
  q = np.exp(draft / 1.5) / np.exp(draft / 1.5).sum(-1, keepdims=True)
  m = (p + q) / 2
  want = {
    "forward_kl": (p * np.log(p / q)).sum(-1),
    "reverse_kl": (q * np.log(q / p)).sum(-1),
    "tvd": 0.5 * np.abs(p - q).sum(-1),
    "jsd": 0.5 * (p * np.log(p / m)).sum(-1) + 0.5 * (q * np.log(q / m)).sum(-1),
  }[name]
  got = losses.divergence(name, jnp.asarray(draft), jnp.asarray(teacher), 1.5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_chunked_loss_equals_one_pass():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(6, 9)), jnp.float32)
  rows = losses.Rows(
    draft=jnp.asarray(rng.normal(size=(23, 6)), jnp.float32),
    teacher=jnp.asarray(rng.normal(size=(23, 6)), jnp.float32),
    weight=jnp.asarray(rng.integers(0, 2, 23), jnp.float32),
    depth=jnp.asarray(rng.integers(1, 4, 23)),
  )
  logits = lambda x: x @ w
  results = [
    losses.loss(rows, logits, 3, losses.LossConfig(chunk=chunk, remat=remat))
    for chunk, remat in [(23, False), (5, True), (4, False)]
  ]
  div = losses.divergence("forward_kl", logits(rows.draft), logits(rows.teacher), 1.0)
  want = float((div * rows.weight).sum() / rows.weight.sum())
  for total, stats in results:
    assert float(total) == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(stats["weight"], results[0][1]["weight"])
    np.testing.assert_allclose(stats["agree"], results[0][1]["agree"])


def _repeating_batch(batch=4, length=24):
  """A fixed 6-token phrase repeated: every continuation is certain after one period."""
  phrase = np.array([3, 7, 1, 12, 9, 5])
  tokens = np.stack([np.roll(np.resize(phrase, length), -r) for r in range(batch)])
  loss_mask = np.zeros_like(tokens, bool)
  loss_mask[:, 6:] = True
  return {"tokens": jnp.asarray(tokens, jnp.int32), "loss_mask": jnp.asarray(loss_mask)}


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
def test_training_on_a_repeating_sequence_drives_the_loss_down(kind):
  target = make_target(3.0).with_scan_layers(True)
  drafter = drafter_lib.random_drafter(kind, target, jax.random.key(0), num_draft=3)
  cfg = step_lib.StepConfig(
    target=target.cfg,
    drafter=drafter.cfg,
    loss=losses.LossConfig(anchors=6, chunk=64, feature_weight=0.1 if kind == "eagle" else 0),
    optimizer=step_lib.OptimizerConfig(lr=1e-2, warmup_steps=2, steps=40),
  )
  state = step_lib.init_state(cfg, drafter.params)
  step = jax.jit(functools.partial(step_lib.train_step, cfg=cfg))
  batch = _repeating_batch()
  history = []
  for _ in range(40):
    state, metrics = step(state, target.params, batch, jax.random.key(0))
    history.append(metrics)
  first, last = history[0], history[-1]
  assert float(last["loss"]) < 0.2 * float(first["loss"])
  depths = 1 if kind == "eagle" else 3  # eagle trains depth 1 alone (teacher forcing)
  agree_first, agree_last = (np.asarray(m["agree_per_depth"])[:depths] for m in (first, last))
  assert (agree_last > 0.8).all() and (agree_last > agree_first).all()
  assert int(state.step) == 40
