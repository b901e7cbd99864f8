"""Training layouts and losses against slow references written from docs/design.md section 2."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import drafter as drafter_lib
from pspec_jax import llama, losses, testing
from train import step as step_lib

S = 12  # row length of the layout tests


def _rows(batch, seed):
  """Loss masks and segments: row 0 holds one conversation, the others two or three packed
  ones (and padding); each conversation is a prompt, then an answer."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((batch, S), bool)
  segments = np.zeros((batch, S), np.int32)
  for row in range(batch):
    cuts = [0, S] if row == 0 else sorted({0, *rng.choice(np.arange(3, S), row, replace=False)})
    for segment, (start, end) in enumerate(zip(cuts, cuts[1:] + [S], strict=False), 1):
      if end <= start:
        continue
      segments[row, start:end] = segment if end < S or row == 0 else 0  # last one: padding
      answer = start + max(1, (end - start) // 3)
      mask[row, answer:end] = segments[row, start] > 0
  return mask, segments


def _reference_layout(anchors, num_slots, loss_mask, segments):
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
    seg = segments[row]
    start = [min(u for u in range(S) if seg[u] == seg[t]) for t in range(S)]
    for t in range(S):
      for u in range(S):
        # Real pairs: causal within their conversation, never slots.
        visible[row, t, u] = u <= t and seg[u] == seg[t]
    for i in range(a):
      anchor = anchors[row, i]
      for d in range(1, num_slots + 1):
        me = S + i * num_slots + d - 1
        position[row, i, d - 1] = anchor - start[anchor] + d  # positions restart per conversation
        predicts = anchor + d + 2  # slot (a, d) predicts x[a + d + 2] ...
        teacher[row, i, d - 1] = min(predicts - 1, S - 1)  # ... distilled from p_{a+d+1}
        inside = predicts < S and seg[predicts] == seg[anchor]
        weight[row, i, d - 1] = loss_mask[row, predicts] if inside else 0.0
        for u in range(S):
          visible[row, me, u] = u <= anchor and seg[u] == seg[anchor]
        for e in range(1, d + 1):
          visible[row, me, S + i * num_slots + e - 1] = True  # own group, d' <= d
  return position, teacher, weight, visible


def _layout(loss_mask, segments, num_draft, num_anchors, seed, kept=None):
  return losses.slot_layout(
    jnp.asarray(loss_mask),
    jnp.asarray(segments),
    num_draft - 1,
    num_anchors,
    jax.random.key(seed),
    kept,
  )


@pytest.mark.parametrize(("num_draft", "num_anchors"), [(2, 0), (4, 5), (5, S), (3, 1)])
def test_slot_layout_matches_the_reference(num_draft, num_anchors):
  loss_mask, segments = _rows(3, seed=num_draft)
  layout = _layout(loss_mask, segments, num_draft, num_anchors, num_anchors)
  anchors = np.asarray(layout.anchors)
  a = num_anchors or S
  assert anchors.shape == (3, a)
  position, teacher, weight, visible = _reference_layout(
    anchors, num_draft - 1, loss_mask, segments
  )
  for row in range(3):
    assert len(set(anchors[row])) == a  # drawn without replacement
    # Anchors whose first slot is trained come first: all of them when there are enough.
    useful = {
      t for t in range(S - 3) if loss_mask[row, t + 3] and segments[row, t + 3] == segments[row, t]
    }
    assert len(useful & set(anchors[row])) == min(len(useful), a)
  np.testing.assert_array_equal(layout.positions, position)
  np.testing.assert_array_equal(layout.teacher, teacher)
  np.testing.assert_array_equal(layout.weight, weight)
  # The real pairs each group sees: [first, visible).
  for row in range(3):
    for i in range(len(anchors[row])):
      sees = visible[row, S + i * (num_draft - 1), :S]
      assert sees.nonzero()[0].tolist() == list(range(layout.first[row, i], layout.visible[row, i]))


def test_segment_positions_and_mask():
  segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
  assert losses.segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
  mask = np.asarray(losses.segment_mask(segments))[0]
  assert mask[4].nonzero()[0].tolist() == [3, 4] and mask[2].nonzero()[0].tolist() == [0, 1, 2]


def _kept(num_anchors, num_slots, ratio, floor):
  """COD written from its definition: slot d is kept by the first ceil(A * max(r^d, floor))."""
  return [
    min(num_anchors, int(np.ceil(num_anchors * max(ratio**d, floor) - 1e-9)))
    for d in range(1, num_slots + 1)
  ]


# (K, anchors, keep ratio, keep floor): full layouts and COD ones, every pair or a subsample.
COD_CASES = [
  (2, 0, 1.0, 0.0),
  (4, 5, 1.0, 0.0),
  (5, S, 0.7, 0.2),
  (4, 0, 0.5, 0.0),
  (6, 7, 0.6, 0.3),
]


@pytest.mark.parametrize(("num_draft", "num_anchors", "ratio", "floor"), COD_CASES)
def test_cod_layout_keeps_nested_slot_prefixes(num_draft, num_anchors, ratio, floor):
  loss_mask, segments = _rows(3, seed=num_draft)
  cfg = losses.LossConfig(anchors=num_anchors, keep_ratio=ratio, keep_floor=floor)
  a, p = num_anchors or S, num_draft - 1
  kept = cfg.kept_anchors(a, p)
  assert list(kept) == _kept(a, p, ratio, floor)
  layout = _layout(loss_mask, segments, num_draft, num_anchors, 3, kept)
  anchors = np.asarray(layout.anchors)
  position, teacher, weight, _ = _reference_layout(anchors, p, loss_mask, segments)
  keeps = np.arange(a)[:, None] < np.asarray(_kept(a, p, ratio, floor))  # [A, P]: slot kept
  np.testing.assert_array_equal(layout.positions, position)
  np.testing.assert_array_equal(layout.teacher, teacher)
  np.testing.assert_array_equal(layout.weight, weight * keeps)
  # The tiers run exactly the kept slots: anchor i with its first p_i slots.
  runs = np.zeros((a, p), bool)
  for lo, hi, depth in layout.tiers:
    assert not runs[lo:hi].any()
    runs[lo:hi, :depth] = True
  np.testing.assert_array_equal(runs, keeps)
  for row in range(3):
    assert len(set(anchors[row])) == a
  if ratio < 1 and num_anchors == 0:  # dropping by position would favour the early pairs
    assert (np.diff(anchors, axis=1) < 0).any()


def _fuse_features(params, cfg, embeds, hidden):
  """u_t = Fuse([embed; h]), h = RMSNorm(concat(hidden states) @ W) (or f), from the params."""
  if cfg.feature_layers:
    h = hidden @ params["feature_fuse"]
    h = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.rms_norm_eps)
    hidden = h * params["feature_norm"]["scale"]
  return jnp.concatenate([embeds, hidden], -1) @ params["fuse"]


# Drafter options: the final feature, two fused target layers, a deeper drafter, one shared
# mask vector, and all of them together.
OPTIONS = [
  {},
  dict(feature_layers=(1, 0)),
  dict(num_layers=2),
  dict(mask_input="shared"),
  dict(feature_layers=(0, 1), num_layers=3, mask_input="shared"),
]


# Each option with two of the layouts in turn: every option and every layout, twice or more.
GROUPED_CASES = [
  (options, *COD_CASES[1 + (i + j) % 4]) for i, options in enumerate(OPTIONS) for j in (0, 2)
]


@pytest.mark.parametrize(("options", "num_draft", "num_anchors", "ratio", "floor"), GROUPED_CASES)
def test_grouped_attention_equals_the_full_parallel_group_mask(
  options, num_draft, num_anchors, ratio, floor
):
  """Every kept slot's drafter feature equals one pass over [real pairs; every slot] under the
  reference mask (section 2), with the options' fusion, layers and slot inputs spelled out."""
  target = testing.make_target(2.0)
  drafter = drafter_lib.random_drafter(
    "pspec", target, jax.random.key(3), num_draft=num_draft, **options
  )
  cfg, params = drafter.cfg, drafter.params
  loss_mask, segments = _rows(3, seed=7)
  tokens = jax.random.randint(jax.random.key(1), (3, S), 0, testing.TINY.vocab_size)
  p = num_draft - 1
  kept = losses.LossConfig(keep_ratio=ratio, keep_floor=floor).kept_anchors(num_anchors or S, p)
  layout = _layout(loss_mask, segments, num_draft, num_anchors, 2, kept)
  segments = jnp.asarray(segments)
  pair_positions = losses.segment_positions(segments)
  mask = losses.segment_mask(segments)
  embeds = target.embed(losses.shifted(tokens, 1))
  _, hidden, _ = drafter_lib.read_target(target, cfg, tokens, pair_positions, None, mask)
  assert hidden.shape[-1] == cfg.feature_width
  g_real, g_slots = drafter.apply(
    embeds, hidden, pair_positions, mask, layout, method=drafter_lib.FeatureDrafter.train_forward
  )
  _, _, _, visible = _reference_layout(
    np.asarray(layout.anchors), p, loss_mask, np.asarray(segments)
  )
  a = layout.positions.shape[1]
  u = _fuse_features(params, cfg, embeds, hidden)
  m = params["mask_vector"][None] if cfg.mask_input == "shared" else params["mask_slots"][:p]
  m = jnp.broadcast_to(m, (3, a, p, u.shape[-1])).reshape(3, a * p, -1)
  x = jnp.concatenate([u, m], 1)
  positions = jnp.concatenate([pair_positions, layout.positions.reshape(3, -1)], 1)
  for i in range(cfg.num_layers):
    name = "block" if i == 0 else f"block_{i}"
    block = llama.Block(cfg.layer)
    x, _ = block.apply({"params": params[name]}, x, None, positions, jnp.asarray(visible), None)
  want = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
  want = want * params["norm"]["scale"]
  np.testing.assert_allclose(g_real, want[:, :S], atol=2e-5)
  want_slots = want[:, S:].reshape(3, a, p, -1)
  assert len(g_slots) == len(layout.tiers)
  for (lo, hi, depth), g in zip(layout.tiers, g_slots, strict=True):
    np.testing.assert_allclose(g, want_slots[:, lo:hi, :depth], atol=2e-5)


def _reference_rows(kind, num_draft, loss_mask, segments):
  """(row, teacher index, weight, depth) of every row a kind trains, by loops."""
  rows = []
  for row in range(loss_mask.shape[0]):
    for t in range(S):
      depths = range(1, num_draft + 1) if kind == "medusa" else [1]
      for d in depths:
        predicts = t + d + 1  # pair t / medusa head d at t predicts x[t + d + 1]
        inside = predicts < S and segments[row, predicts] == segments[row, t]
        weight = loss_mask[row, predicts] if inside else 0.0
        rows.append((row, min(predicts - 1, S - 1), weight, d))
  return rows


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_rows_of_eagle_and_medusa_match_the_reference(kind):
  target = testing.make_target(2.0)
  drafter = drafter_lib.random_drafter(kind, target, jax.random.key(3), num_draft=3)
  loss_mask, segments = _rows(3, seed=11)
  tokens = jax.random.randint(jax.random.key(1), (3, S), 0, testing.TINY.vocab_size)
  batch = dict(tokens=tokens, loss_mask=jnp.asarray(loss_mask), segments=jnp.asarray(segments))
  rows, _ = losses.distill_rows(drafter, target, batch, jax.random.key(0), losses.LossConfig())
  seg = jnp.asarray(segments)
  features, _ = target(tokens, losses.segment_positions(seg), None, losses.segment_mask(seg))
  reference = _reference_rows(kind, 3, loss_mask, segments)
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
  assert got == want and len(got) > 5
  np.testing.assert_array_equal(np.asarray(rows.weight)[kept], 1.0)


@pytest.mark.parametrize("options", OPTIONS[1:2] + OPTIONS[4:])
@pytest.mark.parametrize(("num_draft", "num_anchors", "ratio", "floor"), COD_CASES[2:])
def test_pspec_rows_with_cod_match_the_reference(options, num_draft, num_anchors, ratio, floor):
  """distill_rows' rows (depth, teacher, weight) are the real pairs' and the kept slots'."""
  target = testing.make_target(2.0)
  drafter = drafter_lib.random_drafter(
    "pspec", target, jax.random.key(3), num_draft=num_draft, **options
  )
  loss_mask, segments = _rows(3, seed=5)
  tokens = jax.random.randint(jax.random.key(1), (3, S), 0, testing.TINY.vocab_size)
  batch = dict(tokens=tokens, loss_mask=jnp.asarray(loss_mask), segments=jnp.asarray(segments))
  cfg = losses.LossConfig(anchors=num_anchors, keep_ratio=ratio, keep_floor=floor)
  key = jax.random.key(4)
  rows, _ = losses.distill_rows(drafter, target, batch, key, cfg)
  a, p = num_anchors or S, num_draft - 1
  kept = _kept(a, p, ratio, floor)
  anchors = np.asarray(  # the anchors distill_rows draws with this key
    losses.slot_layout(batch["loss_mask"], batch["segments"], p, num_anchors, key, kept).anchors
  )
  seg = jnp.asarray(segments)
  features, _ = target(tokens, losses.segment_positions(seg), None, losses.segment_mask(seg))
  reference = _reference_rows("pspec", num_draft, loss_mask, segments)
  want = [(1, features[b, t], w) for b, t, w, _ in reference]
  for row in range(3):
    for i, anchor in enumerate(anchors[row]):
      for d in range(1, p + 1):
        if i >= kept[d - 1]:
          continue
        predicts = anchor + d + 2
        inside = predicts < S and segments[row, predicts] == segments[row, anchor]
        w = loss_mask[row, predicts] if inside else 0.0
        want.append((d + 1, features[row, min(predicts - 1, S - 1)], w))
  assert rows.weight.size == len(want) == 3 * (S + sum(kept))
  kept_rows = np.asarray(rows.weight) > 0
  got = sorted(
    zip(
      np.asarray(rows.depth)[kept_rows].tolist(),
      np.asarray(rows.teacher)[kept_rows].round(5).tolist(),
      strict=True,
    )
  )
  assert got == sorted((d, np.asarray(f).round(5).tolist()) for d, f, w in want if w)
  assert len(got) > 10 and len({d for d, _ in got}) == num_draft


def test_a_packed_row_trains_like_its_conversations_alone():
  """Packing changes nothing: the rows of a packed conversation equal those of it alone."""
  target = testing.make_target(2.0)
  drafter = drafter_lib.random_drafter("eagle", target, jax.random.key(3), num_draft=3)
  tokens = jax.random.randint(jax.random.key(1), (1, S), 0, testing.TINY.vocab_size)
  segments = jnp.asarray([[1] * 5 + [2] * 7])
  mask = jnp.asarray([[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]], bool)
  packed, _ = losses.distill_rows(
    drafter,
    target,
    dict(tokens=tokens, loss_mask=mask, segments=segments),
    None,
    losses.LossConfig(),
  )
  alone, _ = losses.distill_rows(
    drafter,
    target,
    dict(tokens=tokens[:, 5:], loss_mask=mask[:, 5:], segments=jnp.ones((1, 7), jnp.int32)),
    None,
    losses.LossConfig(),
  )
  np.testing.assert_allclose(packed.draft[5:], alone.draft, atol=1e-5)
  np.testing.assert_array_equal(packed.weight[5:], alone.weight)
  assert packed.weight[4] == 0  # the first conversation's last pair would predict into the next


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
  return {
    "tokens": jnp.asarray(tokens, jnp.int32),
    "loss_mask": jnp.asarray(loss_mask),
    "segments": jnp.ones(tokens.shape, jnp.int32),
  }


# (kind, drafter options, loss options): today's drafters, then each new option.
TRAINING_CASES = [
  ("pspec", {}, {}),
  ("eagle", {}, {}),
  ("medusa", {}, {}),
  ("pspec", dict(feature_layers=(0, 1)), {}),
  ("pspec", dict(num_layers=2), {}),
  ("pspec", dict(mask_input="shared"), {}),
  ("pspec", {}, dict(keep_ratio=0.7, keep_floor=0.3)),
  ("eagle", dict(num_layers=2), {}),
]


@pytest.mark.parametrize(("kind", "options", "loss_options"), TRAINING_CASES)
def test_training_on_a_repeating_sequence_drives_the_loss_down(kind, options, loss_options):
  target = testing.make_target(3.0).with_scan_layers(True)
  drafter = drafter_lib.random_drafter(kind, target, jax.random.key(0), num_draft=3, **options)
  cfg = step_lib.StepConfig(
    target=target.cfg,
    drafter=drafter.cfg,
    loss=losses.LossConfig(
      anchors=6, chunk=64, feature_weight=0.1 if kind == "eagle" else 0, **loss_options
    ),
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
