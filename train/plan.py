"""Memory planning for a training config: per-device bytes, from shapes alone.

Parameters, optimizer state and batches are sized exactly from `jax.eval_shape` and the
shardings the rules give on the configured mesh (an `AbstractMesh`, so no device is needed);
activations are an estimate from the layer sizes (stated as such in the table). When this host
holds the configured hardware's devices, the train step is also compiled for the configured
mesh on abstract arguments, and XLA's memory analysis of that program (outputs and
temporaries, beside the arrays held) is printed too; compiling allocates no array.
"""

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from pspec_jax import drafter as drafter_lib
from pspec_jax import llama, sharding
from pspec_jax.presets import not_this_host
from train.step import StepConfig, abstract_batch, jit_init, jit_train_step, placement

GIB = 1024**3


def abstract_mesh(config) -> AbstractMesh:
  shape = sharding.mesh_shape(config.hardware.devices, **config.mesh.to_dict())
  return AbstractMesh(shape, sharding.AXES, axis_types=(AxisType.Auto,) * 3)


def activation_bytes(config, cfg: StepConfig, mesh: AbstractMesh) -> dict[str, int]:
  """Estimated peak activation bytes per device of one train step.

  - target forward (no gradients: one layer live at a time): residual, q/k/v/o, MLP hidden
    and the attention scores of one layer for the device's tokens;
  - drafter forward kept for the backward pass: about 12 D + 3 F floats per row (real pairs
    plus mask slots) and its attention scores;
  - loss: draft and teacher logits of one chunk, with their softmaxes and gradient.
  """
  t, d = cfg.target, cfg.drafter
  width = np.dtype(t.dtype).itemsize
  per_step = config.train.batch_size // config.train.microbatches
  seqs = max(per_step // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
  s = config.data.seq_len
  tokens = seqs * s
  tensor = mesh.shape["tensor"]
  heads = max(t.num_heads // tensor, 1)
  target = tokens * (6 * t.hidden_size + 3 * t.intermediate_size // tensor) * width
  target += seqs * heads * s * s * 4
  slots = 0
  if d.kind == "pspec":
    anchors = config.loss.anchors or s
    slots = seqs * min(anchors, s) * (d.num_draft - 1)
  rows = tokens + slots if d.kind != "medusa" else tokens * d.num_draft
  drafter = rows * (12 * d.hidden_size + 3 * d.intermediate_size) * 4
  drafter += seqs * d.num_heads * (s * s + slots // max(seqs, 1) * s) * 4 * 2
  vocab = d.draft_vocab_size or t.vocab_size
  loss = 6 * min(config.loss.chunk, rows) * vocab // tensor * 4
  return {"target forward": target, "drafter (saved for backward)": drafter, "loss chunk": loss}


def held_bytes(config, cfg: StepConfig, mesh) -> dict[str, int]:
  """Exact per-device bytes of the arrays a run holds through every step."""
  place = placement(cfg, mesh)
  key = jax.random.key(0)
  target = jax.eval_shape(lambda: llama.init_params(cfg.target, key))
  params = jax.eval_shape(lambda: drafter_lib.init_params(cfg.drafter, key))
  opt = jax.eval_shape(cfg.optimizer.make().init, params)
  batch = abstract_batch(cfg, config.train.batch_size, config.data.seq_len)
  return {
    "target params": sharding.bytes_per_device(target, place.target),
    "drafter params": sharding.bytes_per_device(params, place.state.params),
    "optimizer state": sharding.bytes_per_device(opt, place.state.opt_state),
    "batch": sum(sharding.bytes_per_device(batch[k], place.batch[k]) for k in batch),
  }


def count_params(cfg: StepConfig) -> tuple[int, int]:
  """Parameter counts of the target and the drafter."""
  key = jax.random.key(0)
  count = lambda init: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(init)))
  return (
    count(lambda: llama.init_params(cfg.target, key)),
    count(lambda: drafter_lib.init_params(cfg.drafter, key)),
  )


def _table(rows: dict[str, int], total_name: str, total: int, memory_gib: float) -> list[str]:
  verdict = "fits" if total <= memory_gib * GIB else "does NOT fit"
  lines = [f"{name:34s} {b / GIB:9.3f}" for name, b in rows.items()]
  return lines + [f"{total_name:34s} {total / GIB:9.3f}  {verdict} in {memory_gib:g} GiB"]


def memory_table(config, cfg: StepConfig) -> str:
  """A text table of per-device bytes and whether they fit the configured accelerator."""
  mesh = abstract_mesh(config)
  rows = held_bytes(config, cfg, mesh)
  rows.update({f"{k} (est.)": v for k, v in activation_bytes(config, cfg, mesh).items()})
  target, drafter = count_params(cfg)
  lines = [
    f"target {cfg.target.name}: {target / 1e9:.3f}B parameters; "
    f"drafter {cfg.drafter.kind}: {drafter / 1e6:.1f}M trainable",
    f"hardware {config.hardware.name}: {config.hardware.devices} devices, "
    f"{config.hardware.memory_gib:g} GiB each; mesh "
    + ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
    + f"; batch {config.train.batch_size} x {config.data.seq_len} tokens"
    + f" in {config.train.microbatches} microbatch(es)",
    f"{'per device':34s} {'GiB':>9s}",
  ]
  lines += _table(rows, "total", sum(rows.values()), config.hardware.memory_gib)
  return "\n".join(lines)


def compiled_bytes(config, cfg: StepConfig, mesh) -> dict[str, int]:
  """Per-device bytes of the train step compiled for `mesh` (a concrete one), from XLA's
  memory analysis; the step is lowered on abstract, sharded arguments, so nothing is allocated.
  """
  place = placement(cfg, mesh)
  key = jax.random.key(0)
  vocab = cfg.drafter.draft_vocab_size
  vocab = jax.ShapeDtypeStruct((vocab,), np.int32) if vocab else None
  state = jax.eval_shape(jit_init(cfg, place), key, vocab)
  target = jax.eval_shape(lambda: llama.init_params(cfg.target, key))
  batch = abstract_batch(cfg, config.train.batch_size, config.data.seq_len)
  state, target, batch = (
    sharding.abstract(tree, placed)
    for tree, placed in ((state, place.state), (target, place.target), (batch, place.batch))
  )
  stats = jit_train_step(cfg, place).lower(state, target, batch, key).compile().memory_analysis()
  # XLA counts only the arguments the program reads; every held array stays resident.
  return {
    "arrays held (params, state, batch)": sum(held_bytes(config, cfg, mesh).values()),
    "outputs not aliasing arguments": stats.output_size_in_bytes - stats.alias_size_in_bytes,
    "temporaries": stats.temp_size_in_bytes,
  }


def compiled_memory(config, cfg: StepConfig) -> str:
  """The compiled step's per-device bytes as a table, where this host has the configured
  hardware's devices; otherwise one line says why it was not compiled."""
  want = config.hardware
  if reason := not_this_host(want.devices, want.platform):
    return reason
  rows = compiled_bytes(config, cfg, sharding.make_mesh(**config.mesh.to_dict()))
  lines = [f"compiled train step on {want.devices} {want.platform} device(s), per device"]
  lines += _table(rows, "total", sum(rows.values()), want.memory_gib)
  return "\n".join(lines)
