"""Distillation layouts and losses for every drafter kind (docs/design.md sections 2 and 4).

Tokens x[0..S-1] (0-based); the frozen target gives features f[t] and p_t = softmax(W f[t]/T),
its distribution over x[t+1], and h[t], the feature the drafter reads (f[t], or the hidden
states of the drafter's `feature_layers`; `drafter.read_target`). Each drafter kind turns a
batch into *rows*: a draft feature, the teacher position whose distribution it is distilled
towards, a loss weight and a depth (1..K, the draft position it trains). One chunked loss then
serves every kind.

- pspec: real pair t = (h[t], x[t+1]) at position t gives g_t -> teacher t+1 (it predicts
  x[t+2]), depth 1. For a random subsample of A anchors a, mask slot (a, d), d = 1..K-1, at
  position a + d sees the real pairs <= a and the slots (a, d' <= d) and gives g_{a,d} ->
  teacher a+d+1 (it predicts x[a+d+2]), depth d+1. With COD keep ratios (`LossConfig.keep_ratio`,
  `keep_floor`), slot d exists for the first n_d = ceil(A * max(r^d, floor)) anchors only
  (nested: a group keeps a prefix of its slots), so the slots' cost grows with K far slower.
- eagle: the real pairs alone (depth 1), plus feature regression g_t ~ f[t+1].
- medusa: head d on f[t] -> teacher t+d (it predicts x[t+d+1]), depth d.

A row's weight is the loss mask of the token it predicts: 1 on assistant tokens of the row's
own conversation, 0 in the prompt, on padding and past the end. Rows of S tokens may hold
several conversations (packing): attention, RoPE positions and weights never cross them.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
  "DIVERGENCES",
  "LossConfig",
  "Rows",
  "SlotLayout",
  "distill_rows",
  "loss",
  "segment_mask",
  "segment_positions",
  "slot_layout",
  "shifted",
]

DIVERGENCES = ("forward_kl", "reverse_kl", "tvd", "jsd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """How draft rows are compared with the target.

  Attributes:
    divergence: one of DIVERGENCES (forward KL(p || q) by default).
    temperature: both distributions are softened by it.
    feature_weight: weight of the smooth-L1 regression g_t ~ f[t+1] on real pairs.
    anchors: pspec anchors per sequence with mask slots; 0 means every pair.
    keep_ratio, keep_floor: COD (conditional drop) for pspec: the d-th mask slot (draft depth
      d + 1) is trained on a fraction max(keep_ratio^d, keep_floor) of the anchors, nested (a
      group keeps slots 1..p for some p). 1.0 keeps every slot of every anchor.
    chunk: rows whose logits are computed at once.
    remat: recompute each chunk's logits in the backward pass (memory: chunk x vocab floats)
      instead of keeping the softmaxes of every row (rows x vocab; faster when it fits).
  """

  divergence: str = "forward_kl"
  temperature: float = 1.0
  feature_weight: float = 0.0
  anchors: int = 64
  keep_ratio: float = 1.0
  keep_floor: float = 0.0
  chunk: int = 512
  remat: bool = True

  def __post_init__(self):
    if self.divergence not in DIVERGENCES:
      raise ValueError(
        f"unknown divergence {self.divergence!r}: use one of {', '.join(DIVERGENCES)}"
      )
    if self.temperature <= 0:
      raise ValueError(f"LossConfig.temperature must be > 0, got {self.temperature}")
    if self.anchors < 0 or self.chunk < 1:
      raise ValueError("LossConfig.anchors must be >= 0 and LossConfig.chunk >= 1")
    if not (0 < self.keep_ratio <= 1 and 0 <= self.keep_floor <= 1):
      raise ValueError(
        f"LossConfig.keep_ratio must be in (0, 1] and keep_floor in [0, 1], got "
        f"{self.keep_ratio} and {self.keep_floor}"
      )

  def kept_anchors(self, num_anchors: int, num_slots: int) -> tuple[int, ...]:
    """n_1 >= ... >= n_P: how many of `num_anchors` anchors keep mask slot d = 1..P (COD)."""
    fractions = [max(self.keep_ratio**d, self.keep_floor) for d in range(1, num_slots + 1)]
    # The small tolerance keeps 0.7 * 10 at 7 anchors, not 8.
    return tuple(max(1, min(num_anchors, math.ceil(num_anchors * f - 1e-9))) for f in fractions)


@struct.dataclass
class SlotLayout:
  """Where pspec's mask slots go in a batch of rows of S tokens.

  anchors: [B, A] real-pair index a of each group; its slots (a, d), d = 1..P (P = K - 1).
  positions: [B, A, P] RoPE positions pos(a) + d (pos: the position inside a's conversation).
  first, visible: [B, A] the real pairs a group sees, [first, visible): those of its own
    conversation with position <= pos(a).
  teacher: [B, A, P] teacher index a + d + 1 of every slot.
  weight: [B, A, P] loss weight: the loss mask of x[a + d + 2], if in a's conversation, and 0
    for a slot COD drops.
  tiers: static ((lo, hi, p), ...): groups lo..hi-1 keep slots 1..p, the others none; the
    drafter runs each tier as [B, hi - lo, p] slots, so dropped slots cost nothing.
  """

  anchors: jax.Array
  positions: jax.Array
  first: jax.Array
  visible: jax.Array
  teacher: jax.Array
  weight: jax.Array
  tiers: tuple[tuple[int, int, int], ...] = struct.field(pytree_node=False, default=())


def shifted(x_BS: jax.Array, by: int) -> jax.Array:
  """y[:, t] = x[:, t + by], zero (False) past the end; any trailing dims."""
  pad = jnp.zeros((x_BS.shape[0], by, *x_BS.shape[2:]), x_BS.dtype)
  return jnp.concatenate([x_BS[:, by:], pad], axis=1)


def segment_starts(segments_BS: jax.Array) -> jax.Array:
  """Index of the first token of each token's conversation (rows hold packed conversations)."""
  index = jnp.arange(segments_BS.shape[1], dtype=jnp.int32)
  previous = jnp.concatenate([jnp.full_like(segments_BS[:, :1], -1), segments_BS[:, :-1]], 1)
  return jax.lax.cummax(jnp.where(segments_BS != previous, index, 0), axis=1)


def segment_positions(segments_BS: jax.Array) -> jax.Array:
  """RoPE positions: 0, 1, ... restarting at every conversation of a packed row."""
  return jnp.arange(segments_BS.shape[1], dtype=jnp.int32) - segment_starts(segments_BS)


def segment_mask(segments_BS: jax.Array) -> jax.Array:
  """[B, S, S] causal attention within each conversation."""
  s = segments_BS.shape[1]
  same = segments_BS[:, :, None] == segments_BS[:, None, :]
  return same & jnp.tril(jnp.ones((s, s), jnp.bool_))


def real_weights(loss_mask_BS: jax.Array, segments_BS: jax.Array, depth: int = 1) -> jax.Array:
  """Weight of the row at t that predicts x[t + depth + 1] (in t's own conversation)."""
  ahead = depth + 1
  same = shifted(segments_BS, ahead) == segments_BS
  return (shifted(loss_mask_BS, ahead) & same).astype(jnp.float32)


def slot_layout(
  loss_mask_BS: jax.Array,
  segments_BS: jax.Array,
  num_slots: int,
  num_anchors: int,
  key,
  kept: tuple[int, ...] | None = None,
) -> SlotLayout:
  """Chooses anchors and lays out their mask slots (jittable, shapes static).

  With `num_anchors` = 0 every pair anchors a group. Otherwise `num_anchors` anchors are drawn
  without replacement, uniformly among those whose first slot has a loss (x[a+3] trained);
  when there are fewer such anchors, the rest are drawn from the others and carry no loss.
  `kept` (COD, `LossConfig.kept_anchors`): slot d exists for the first kept[d-1] anchors only;
  anchors are then in that random order (every pair too, with `num_anchors` = 0).
  """
  b, s = loss_mask_BS.shape
  a = min(num_anchors or s, s)
  kept = tuple(kept or (a,) * num_slots)
  if num_anchors == 0 and kept[-1] == a:
    anchors = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  else:
    useful = real_weights(loss_mask_BS, segments_BS, 2)
    score = jax.random.uniform(key, (b, s)) + useful
    anchors = jax.lax.top_k(score, a)[1].astype(jnp.int32)
  d = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
  take = lambda x_BS, index: jnp.take_along_axis(x_BS, index.reshape(b, -1), 1).reshape(index.shape)
  first = take(segment_starts(segments_BS), anchors)
  # Slot (a, d) predicts x[a + d + 2]: its weight is that token's loss mask, if it belongs to
  # a's conversation (0 past the end).
  predicts = anchors[..., None] + d + 2
  inside = jnp.minimum(predicts, s - 1)
  same = take(segments_BS, inside) == take(segments_BS, anchors)[..., None]
  weight = take(loss_mask_BS, inside) & same & (predicts < s)
  # Groups [kept[p], kept[p - 1]) keep slots 1..p (kept[P] = 0).
  bounds = (*kept, 0)
  tiers = tuple((bounds[p], bounds[p - 1], p) for p in range(num_slots, 0, -1))
  tiers = tuple(t for t in tiers if t[1] > t[0])
  weight = weight & (jnp.arange(a)[:, None] < jnp.asarray(kept))
  return SlotLayout(
    anchors=anchors,
    positions=(anchors - first)[..., None] + d,
    first=first,
    visible=anchors + 1,
    teacher=jnp.minimum(anchors[..., None] + d + 1, s - 1),
    weight=weight.astype(jnp.float32),
    tiers=tiers,
  )


def divergence(name: str, draft_RV: jax.Array, teacher_RV: jax.Array, temperature: float):
  """Per-row divergence between the teacher distribution p and the draft distribution q."""
  log_q = jax.nn.log_softmax(draft_RV.astype(jnp.float32) / temperature, axis=-1)
  log_p = jax.nn.log_softmax(teacher_RV.astype(jnp.float32) / temperature, axis=-1)
  p, q = jnp.exp(log_p), jnp.exp(log_q)
  if name == "forward_kl":
    return jnp.sum(p * (log_p - log_q), axis=-1)
  if name == "reverse_kl":
    return jnp.sum(q * (log_q - log_p), axis=-1)
  if name == "tvd":
    return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
  log_m = jnp.log(0.5 * (p + q))
  return 0.5 * jnp.sum(p * (log_p - log_m) + q * (log_q - log_m), axis=-1)


def smooth_l1(x, y):
  diff = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
  return jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)


@struct.dataclass
class Rows:
  """Draft rows and what they are distilled towards; any leading shape, flattened by `loss`."""

  draft: jax.Array  # [..., D] drafter features (LM-head inputs)
  teacher: jax.Array  # [..., D] the target's features at the teacher position
  weight: jax.Array  # [...]
  depth: jax.Array  # [...] int, 1..K

  @staticmethod
  def concat(rows: list["Rows"]) -> "Rows":
    """All rows flattened into one list: [R, D] features, [R] weights and depths."""
    return Rows(
      draft=jnp.concatenate([r.draft.reshape(-1, r.draft.shape[-1]) for r in rows]),
      teacher=jnp.concatenate([r.teacher.reshape(-1, r.teacher.shape[-1]) for r in rows]),
      weight=jnp.concatenate([r.weight.reshape(-1) for r in rows]),
      depth=jnp.concatenate([r.depth.reshape(-1) for r in rows]),
    )


def loss(rows: Rows, logits_fn, num_depths: int, cfg: LossConfig):
  """Weighted mean divergence over rows, and per-depth statistics.

  The LM head runs over `cfg.chunk` rows at a time; under `jax.checkpoint` (`cfg.remat`)
  neither the draft nor the teacher logits of the whole batch are ever held in memory.

  Returns:
    (loss, stats): stats has per-depth sums `weight` [K], `divergence` [K] and `agree` [K]
    (top-1 agreement of draft and teacher), whose ratios are the metrics.
  """
  d = rows.draft.shape[-1]
  draft = rows.draft.reshape(-1, d)
  teacher = jax.lax.stop_gradient(rows.teacher.reshape(-1, d))
  weight, depth = rows.weight.reshape(-1), rows.depth.reshape(-1)
  n = draft.shape[0]
  chunk = min(cfg.chunk, n)
  pad = -n % chunk
  if pad:
    draft, teacher = (jnp.pad(x, ((0, pad), (0, 0))) for x in (draft, teacher))
    weight, depth = jnp.pad(weight, (0, pad)), jnp.pad(depth, (0, pad), constant_values=1)

  def one_chunk(stats, xs):
    g, f, w, dep = xs
    draft_logits = logits_fn(g)
    teacher_logits = jax.lax.stop_gradient(logits_fn(f))
    div = divergence(cfg.divergence, draft_logits, teacher_logits, cfg.temperature)
    agree = jnp.argmax(draft_logits, -1) == jnp.argmax(teacher_logits, -1)
    onehot = jax.nn.one_hot(dep - 1, num_depths) * w[:, None]
    return jax.tree.map(
      jnp.add, stats, dict(weight=onehot.sum(0), divergence=div @ onehot, agree=agree @ onehot)
    ), None

  zeros = jnp.zeros((num_depths,), jnp.float32)
  split = lambda x: x.reshape(-1, chunk, *x.shape[1:])
  stats, _ = jax.lax.scan(
    jax.checkpoint(one_chunk) if cfg.remat else one_chunk,
    dict(weight=zeros, divergence=zeros, agree=zeros),
    (split(draft), split(teacher), split(weight), split(depth)),
  )
  total = stats["divergence"].sum() / jnp.maximum(stats["weight"].sum(), 1.0)
  return total, stats


def distill_rows(drafter, target, batch: dict, key, cfg: LossConfig):
  """Runs the frozen target and the drafter over a batch: (Rows, feature regression loss).

  Args:
    drafter: a `drafter.Drafter` of kind pspec, eagle or medusa (parameters being trained).
    target: the frozen `llama.Target` (gradients stop at its features).
    batch: `tokens` [B, S] int, `loss_mask` [B, S] bool (True on tokens the drafter should
      learn to predict) and `segments` [B, S] int (the conversations packed into each row,
      numbered from 1; 0 is padding); optionally `features` [B, S, D (+ E)], the target's
      features of these tokens computed beforehand (`stored_features`: f, then h when the
      drafter has feature layers), in which case the target is not run.
    key: draws the pspec anchors.
    cfg: the loss settings.
  """
  from pspec_jax.drafter import FeatureDrafter, read_target

  tokens_BS, loss_mask_BS, segments_BS = batch["tokens"], batch["loss_mask"], batch["segments"]
  b, s = tokens_BS.shape
  positions, mask = segment_positions(segments_BS), segment_mask(segments_BS)
  if "features" in batch:
    stored = batch["features"].astype(target.cfg.dtype)
    d = target.cfg.hidden_size
    features, hidden = stored[..., :d], stored[..., d:] if drafter.cfg.feature_layers else None
    hidden = features if hidden is None else hidden
  else:
    features, hidden, _ = read_target(target, drafter.cfg, tokens_BS, positions, None, mask)
  features, hidden = jax.lax.stop_gradient((features, hidden))
  kind, k = drafter.cfg.kind, drafter.cfg.num_draft
  if kind == "medusa":
    heads_BSKD = drafter.apply(features.reshape(b * s, -1)).reshape(b, s, k, -1)
    depth = np.arange(1, k + 1)
    teacher = np.minimum(np.arange(s)[:, None] + depth, s - 1)  # [S, K]: t + d
    weight = jnp.stack([real_weights(loss_mask_BS, segments_BS, int(d)) for d in depth], -1)
    rows = Rows(
      draft=heads_BSKD,
      teacher=features[:, teacher],
      weight=weight,
      depth=jnp.broadcast_to(depth, (b, s, k)),
    )
    return rows, jnp.float32(0.0)
  if kind not in ("pspec", "eagle"):
    raise ValueError(f"a {kind} drafter has nothing to train")
  layout = None
  if kind == "pspec" and k > 1:
    kept = cfg.kept_anchors(min(cfg.anchors or s, s), k - 1)
    layout = slot_layout(loss_mask_BS, segments_BS, k - 1, cfg.anchors, key, kept)
  embeds = target.embed(shifted(tokens_BS, 1))
  g_real, g_slots = drafter.apply(
    embeds, hidden, positions, mask, layout, method=FeatureDrafter.train_forward
  )
  next_features = shifted(features, 1)
  real_weight = real_weights(loss_mask_BS, segments_BS, 1)
  rows = [Rows(g_real, next_features, real_weight, jnp.ones((b, s), jnp.int32))]
  for (lo, hi, p), g in zip(layout.tiers if layout else (), g_slots or (), strict=True):
    index = layout.teacher[:, lo:hi, :p].reshape(b, -1)[..., None]
    teacher = jnp.take_along_axis(features, index, axis=1).reshape(g.shape)
    weight = layout.weight[:, lo:hi, :p]
    rows.append(Rows(g, teacher, weight, jnp.broadcast_to(jnp.arange(2, p + 2), weight.shape)))
  regression = smooth_l1(g_real, next_features)
  feature_loss = jnp.sum(regression * real_weight) / jnp.maximum(real_weight.sum(), 1.0)
  return Rows.concat(rows), feature_loss


def depth1_guesses(drafter, target, tokens_BS: jax.Array) -> jax.Array:
  """[B, S] token ids: the drafter's depth-1 guess of every pair, teacher-forced.

  Pair a = (f_a, x_{a+1}) guesses x_{a+2} (medusa: its first head on f_a), in the layout that
  `distill_rows` trains at depth 1 and decoding's proposals are tested to equal. Each row is one
  sequence; its last two guesses look past its end.
  """
  _, draft_BSV = depth1_logits(drafter, target, tokens_BS)
  return drafter.token_ids(jnp.argmax(draft_BSV, -1))


def depth1_logits(drafter, target, tokens_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(target_BSV, draft_BSV): the target's logits at every position (position t predicts
  x_{t+1}) and the drafter's depth-1 logits of every pair (pair a predicts x_{a+2}, over the
  draft vocabulary), teacher-forced as in `depth1_guesses`."""
  from pspec_jax.drafter import FeatureDrafter, read_target

  segments_BS = jnp.ones_like(tokens_BS)
  positions, mask = segment_positions(segments_BS), segment_mask(segments_BS)
  features_BSD, hidden_BSE, _ = read_target(target, drafter.cfg, tokens_BS, positions, None, mask)
  if drafter.cfg.kind == "medusa":
    b, s, d = features_BSD.shape
    g_BSD = drafter.apply(features_BSD.reshape(b * s, d)).reshape(b, s, -1, d)[:, :, 0]
  else:
    g_BSD, _ = drafter.apply(
      target.embed(shifted(tokens_BS, 1)),
      hidden_BSE,
      positions,
      mask,
      None,
      method=FeatureDrafter.train_forward,
    )
  return target.logits(features_BSD), drafter.logits(target, g_BSD)
