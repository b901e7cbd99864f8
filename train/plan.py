"""Memory planning for a training config: per-device bytes, from shapes alone.

Parameters, optimizer state and batches are sized exactly from `jax.eval_shape` and the
shardings the rules give on the configured mesh (an `AbstractMesh`, so no device is needed);
activations are an estimate from the layer sizes (stated as such in the table).
"""

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from pspec_jax import drafter as drafter_lib
from pspec_jax import llama, sharding
from train.step import StepConfig, placement

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


def memory_table(config, cfg: StepConfig) -> str:
  """A text table of per-device bytes and whether they fit the configured accelerator."""
  mesh = abstract_mesh(config)
  place = placement(cfg, mesh)
  key = jax.random.key(0)
  target = jax.eval_shape(lambda: llama.init_params(cfg.target, key))
  params = jax.eval_shape(lambda: drafter_lib.init_params(cfg.drafter, key))
  opt = jax.eval_shape(cfg.optimizer.make().init, params)
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  rows = {
    "target params": sharding.bytes_per_device(target, place.target),
    "drafter params": sharding.bytes_per_device(params, place.state.params),
    "optimizer state": sharding.bytes_per_device(opt, place.state.opt_state),
  }
  batch = jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len), np.int32)
  rows["batch"] = 2 * sharding.bytes_per_device(batch, place.batch["tokens"])
  rows.update({f"{k} (est.)": v for k, v in activation_bytes(config, cfg, mesh).items()})
  total = sum(rows.values())
  budget = config.hardware.memory_gib * GIB
  lines = [
    f"target {cfg.target.name}: {count(target) / 1e9:.3f}B parameters; "
    f"drafter {cfg.drafter.kind}: {count(params) / 1e6:.1f}M trainable",
    f"hardware {config.hardware.name}: {config.hardware.devices} devices, "
    f"{config.hardware.memory_gib:g} GiB each; mesh "
    + ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
    + f"; batch {config.train.batch_size} x {config.data.seq_len} tokens"
    + f" in {config.train.microbatches} microbatch(es)",
    f"{'per device':34s} {'GiB':>9s}",
  ]
  lines += [f"{name:34s} {b / GIB:9.3f}" for name, b in rows.items()]
  verdict = "fits" if total <= budget else "does NOT fit"
  lines.append(f"{'total':34s} {total / GIB:9.3f}  {verdict} in {config.hardware.memory_gib:g} GiB")
  return "\n".join(lines)
