"""The pure distillation train step: (state, target_params, batch, key) -> (state, metrics).

The frozen target's parameters are an argument of every step, never part of the train state:
they get no gradients, no optimizer moments and no checkpoint.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from pspec_jax import losses
from pspec_jax.drafter import Drafter, DrafterConfig
from pspec_jax.llama import LlamaConfig, Target

BATCH_KEYS = ("tokens", "loss_mask", "segments")  # each [B, S]; see `losses.distill_rows`
# [B, S, D] the target's features, when precomputed; [B, S, D + E] with the hidden states of
# the drafter's feature layers after them (`train.features`).
FEATURES_KEY = "features"


@struct.dataclass
class TrainState:
  step: jax.Array
  params: Any  # the drafter's
  opt_state: Any
  draft_vocab: jax.Array | None = None  # [V'] token ids the drafter proposes (fixed, untrained)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  lr: float = 1e-3
  warmup_steps: int = 100
  steps: int = 1000
  end_lr_ratio: float = 0.1
  weight_decay: float = 0.01
  clip_norm: float = 1.0

  def __post_init__(self):
    # Checked when the config is read (before anything loads or compiles, in --dry_run too):
    # a NaN or negative rate would only show as a non-finite update steps later.
    checks = (
      ("lr", self.lr >= 0, ">= 0 (0 keeps the weights as they are)"),
      ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
      ("steps", self.steps >= 1, ">= 1"),
      ("end_lr_ratio", 0 <= self.end_lr_ratio <= 1, "between 0 and 1"),
      ("weight_decay", self.weight_decay >= 0, ">= 0"),
      ("clip_norm", self.clip_norm > 0, "> 0"),
    )
    for name, ok, want in checks:
      value = getattr(self, name)
      if not (math.isfinite(value) and ok):
        raise ValueError(f"train.{name}={value}: it must be a finite number {want}")

  def schedule(self) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine decay to `lr * end_lr_ratio` at `steps`."""
    return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=self.lr,
      warmup_steps=self.warmup_steps,
      decay_steps=max(self.steps, self.warmup_steps + 1),
      end_value=self.lr * self.end_lr_ratio,
    )

  def make(self) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; vectors (norm scales, biases) are not decayed."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)
    return optax.chain(
      optax.clip_by_global_norm(self.clip_norm),
      optax.adamw(self.schedule(), weight_decay=self.weight_decay, mask=decay_mask),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  """Everything static about a step (hashable)."""

  target: LlamaConfig
  drafter: DrafterConfig
  loss: losses.LossConfig
  optimizer: OptimizerConfig
  microbatches: int = 1  # gradient accumulation: the batch is split into this many parts
  cached_features: bool = False  # batches carry the target's features (no target forward)

  def __post_init__(self):
    if self.microbatches < 1:
      raise ValueError(f"train.microbatches must be >= 1, got {self.microbatches}")


def batch_keys(cfg: StepConfig) -> tuple[str, ...]:
  """The arrays a batch holds."""
  return BATCH_KEYS + ((FEATURES_KEY,) if cfg.cached_features else ())


def abstract_batch(cfg: StepConfig, batch_size: int, seq_len: int) -> dict:
  """Shapes and dtypes of a batch, as `data.TokenData.batch` gives it."""
  shape = (batch_size, seq_len)
  batch = {
    "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
    "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
    "segments": jax.ShapeDtypeStruct(shape, jnp.int32),
  }
  if cfg.cached_features:
    width = cfg.target.hidden_size * (1 + len(cfg.drafter.feature_layers))
    batch[FEATURES_KEY] = jax.ShapeDtypeStruct((*shape, width), jnp.float32)
  return batch


def init_state(cfg: StepConfig, params, draft_vocab=None) -> TrainState:
  """A fresh state; `draft_vocab` is required when the drafter has a restricted vocabulary."""
  size = cfg.drafter.draft_vocab_size
  if (draft_vocab is None) != (size == 0) or (size and draft_vocab.shape != (size,)):
    got = "none" if draft_vocab is None else f"{draft_vocab.shape[0]} tokens"
    raise ValueError(f"the drafter needs a draft vocabulary of {size} tokens, got {got}")
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=cfg.optimizer.make().init(params),
    draft_vocab=draft_vocab,
  )


def _loss_and_stats(params, target_params, draft_vocab, batch, key, cfg: StepConfig):
  target = Target(cfg=cfg.target, params=target_params)
  drafter = Drafter(cfg=cfg.drafter, params=params, vocab=draft_vocab).with_head(target)
  rows, feature_loss = losses.distill_rows(drafter, target, batch, key, cfg.loss)
  # Draft and teacher distributions over the draft vocabulary (the teacher's renormalised).
  logits = functools.partial(drafter.logits, target)
  divergence, stats = losses.loss(rows, logits, cfg.drafter.num_draft, cfg.loss)
  total = divergence + cfg.loss.feature_weight * feature_loss
  return total, dict(stats, divergence=divergence, feature_loss=feature_loss)


def _metrics(total, stats, cfg: StepConfig) -> dict:
  # eagle trains depth 1 only (deeper drafts feed on its own outputs when decoding).
  depths = 1 if cfg.drafter.kind == "eagle" else cfg.drafter.num_draft
  weight = jnp.maximum(stats["weight"][:depths], 1.0)
  return {
    "loss": total,
    "divergence": stats["divergence"],
    "feature_loss": stats["feature_loss"],
    "agree_per_depth": stats["agree"][:depths] / weight,
    "tokens": stats["weight"][0],
  }


def train_step(state: TrainState, target_params, batch: dict, key: jax.Array, *, cfg: StepConfig):
  """One AdamW step on the drafter; the key is folded with the step (anchor sampling)."""
  key = jax.random.fold_in(key, state.step)
  loss_fn = functools.partial(_loss_and_stats, cfg=cfg)
  grad_fn = functools.partial(
    jax.value_and_grad(loss_fn, has_aux=True),
    target_params=target_params,
    draft_vocab=state.draft_vocab,
  )
  n = cfg.microbatches
  if n == 1:
    (total, stats), grads = grad_fn(state.params, batch=batch, key=key)
  else:
    # Part j takes rows j, j + n, ...: every device keeps its own rows in each part.
    parts = jax.tree.map(lambda x: x.reshape(-1, n, *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(carry, part_and_index):
      part, index = part_and_index
      out = grad_fn(state.params, batch=part, key=jax.random.fold_in(key, index))
      return jax.tree.map(jnp.add, carry, out), None

    zeros = jax.eval_shape(lambda p: grad_fn(p, batch=batch, key=key), state.params)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zeros)
    summed, _ = jax.lax.scan(accumulate, zeros, (parts, jnp.arange(n)))
    # Means over parts (the loss of each part is its own weighted mean); per-depth counts add.
    (total, stats), grads = jax.tree.map(lambda x: x / n, summed)
    for name in ("weight", "agree"):
      stats[name] = summed[0][1][name]
  updates, opt_state = cfg.optimizer.make().update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = _metrics(total, stats, cfg)
  metrics["grad_norm"] = optax.tree.norm(grads)
  metrics["lr"] = cfg.optimizer.schedule()(state.step)
  # A non-finite loss, gradient or update is never committed: the state stays the one before
  # the step (its step count too), so whatever is saved or exported afterwards is finite.
  # `finite_gradient` false: the state's own weights fail on this batch (whatever the rate).
  metrics["finite_gradient"] = all_finite((total, grads))
  finite = metrics["finite_gradient"] & all_finite((params, opt_state))
  metrics["finite"] = finite
  keep = lambda new, old: jnp.where(finite, new, old)
  new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return jax.tree.map(keep, new, state), metrics


def all_finite(tree) -> jax.Array:
  """True when every floating-point number in `tree` is finite (no NaN, no Inf)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def eval_step(state: TrainState, target_params, batch: dict, key: jax.Array, *, cfg) -> dict:
  """Held-out loss and per-depth agreement (same layout, no update)."""
  total, stats = _loss_and_stats(
    state.params, target_params, state.draft_vocab, batch, key, cfg=cfg
  )
  return _metrics(total, stats, cfg)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Shardings of everything a step touches, from the logical-axis rules and a mesh."""

  mesh: Any
  target: Any  # tree of NamedSharding, like the target params
  state: TrainState  # of NamedSharding
  batch: dict
  replicated: Any


def placement(cfg: StepConfig, mesh) -> Placement:
  """Shardings for a mesh (a `Mesh`, or an `AbstractMesh` for planning); allocates nothing."""
  from pspec_jax import drafter as drafter_lib
  from pspec_jax import llama, sharding

  key = jax.random.key(0)
  target = sharding.param_shardings(llama.init_boxed, cfg.target, mesh)
  params = sharding.param_shardings(drafter_lib.init_boxed, cfg.drafter, mesh)
  drafter_shapes = jax.eval_shape(lambda: drafter_lib.init_params(cfg.drafter, key))
  replicated = sharding.replicated(mesh)
  opt_shapes = jax.eval_shape(cfg.optimizer.make().init, drafter_shapes)
  opt_state = optax.tree_map_params(
    cfg.optimizer.make(),
    lambda _, s: s,
    opt_shapes,
    params,
    transform_non_params=lambda _: replicated,
  )
  vocab = replicated if cfg.drafter.draft_vocab_size else None
  state = TrainState(step=replicated, params=params, opt_state=opt_state, draft_vocab=vocab)
  batch = {name: sharding.batch_sharding(mesh) for name in batch_keys(cfg)}
  return Placement(mesh=mesh, target=target, state=state, batch=batch, replicated=replicated)


def jit_init(cfg: StepConfig, place: Placement):
  """(key, draft_vocab) -> a fresh TrainState, created directly in its shardings."""
  from pspec_jax import drafter as drafter_lib

  return jax.jit(
    lambda key, vocab: init_state(cfg, drafter_lib.init_params(cfg.drafter, key), vocab),
    out_shardings=place.state,
  )


def jit_init_from(cfg: StepConfig, place: Placement):
  """(drafter params, draft_vocab) -> a fresh TrainState that starts from those parameters."""
  return jax.jit(
    lambda params, vocab: init_state(
      cfg, jax.tree.map(lambda p: p.astype(cfg.drafter.param_dtype), params), vocab
    ),
    out_shardings=place.state,
  )


def jit_train_step(cfg: StepConfig, place: Placement):
  """The jitted, sharded `train_step`; the state argument is donated."""
  return jax.jit(
    functools.partial(train_step, cfg=cfg),
    in_shardings=(place.state, place.target, place.batch, place.replicated),
    out_shardings=(place.state, place.replicated),
    donate_argnums=0,
  )


def jit_eval_step(cfg: StepConfig, place: Placement):
  return jax.jit(
    functools.partial(eval_step, cfg=cfg),
    in_shardings=(place.state, place.target, place.batch, place.replicated),
    out_shardings=place.replicated,
  )
