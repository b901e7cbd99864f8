"""Turns an experiment config (ml_collections) into library objects; shared by train mains."""

import dataclasses
import math
import os

import jax.numpy as jnp
import ml_collections

from pspec_jax import checkpoints, drafter_files, llama
from pspec_jax.drafter import DrafterConfig

# Settings of a drafter that its weights do not fix: a starting drafter may differ in them.
_FREE_FIELDS = (
  "tree",
  "sampling_tree",
  "adaptive",
  "sampling_adaptive",
  "max_ngram",
  "dtype",
  "param_dtype",
  "weight_layout",
)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def storage_dtype(name: str):
  """A numpy dtype for files: float32 or bfloat16 (ml_dtypes)."""
  import ml_dtypes
  import numpy as np

  types = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
  if name not in types:
    raise ValueError(f"unknown storage dtype {name!r}: use float32 or bfloat16")
  return types[name]


def dtype(name: str):
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
  return DTYPES[name]


def target_config(config: ml_collections.ConfigDict, scan_layers: bool = True) -> llama.LlamaConfig:
  """The target architecture the config declares (no checkpoint needed)."""
  arch = config.target.arch.to_dict()
  if arch.get("rope_scaling"):
    arch["rope_scaling"] = llama.RopeScaling(**arch["rope_scaling"])
  name = os.path.basename(os.path.normpath(config.target.checkpoint))
  return llama.LlamaConfig(
    name=name.removesuffix(".gguf"),
    **arch,
    scan_layers=scan_layers,
    dtype=dtype(config.target.dtype),
    param_dtype=dtype(config.target.param_dtype),
  )


def check_target_exists(config: ml_collections.ConfigDict) -> None:
  """A clear error for a missing checkpoint, before anything is compiled or allocated."""
  checkpoints.resolve_target(config.target.checkpoint)


def load_target(
  config: ml_collections.ConfigDict, scan_layers: bool = True, weight_layout: str = "plain"
) -> llama.Target:
  """Loads the checkpoint and checks it is the architecture the config declares."""
  target = checkpoints.load_target(
    config.target.checkpoint,
    dtype=dtype(config.target.dtype),
    param_dtype=dtype(config.target.param_dtype),
    scan_layers=scan_layers,
    weight_layout=weight_layout,
  )
  declared = target_config(config, scan_layers)
  for field, value in config.target.arch.items():
    got = getattr(target.cfg, field)
    want = getattr(declared, field)
    same = math.isclose(got, want, rel_tol=1e-6) if isinstance(want, float) else got == want
    if not same:
      raise ValueError(
        f"config.target.arch.{field}={value} but the checkpoint {config.target.checkpoint} "
        f"has {got}: fix the config"
      )
  return target


def drafter_config(config: ml_collections.ConfigDict, target: llama.LlamaConfig) -> DrafterConfig:
  d = config.drafter
  return DrafterConfig.for_target(
    d.kind,
    target,
    num_draft=d.num_draft,
    tree=d.tree,
    sampling_tree=d.sampling_tree,
    dtype=dtype(d.dtype),
    param_dtype=dtype(d.param_dtype),
    draft_vocab_size=d.draft_vocab_size,
    num_layers=d.num_layers,
    feature_layers=tuple(d.feature_layers),
    mask_input=d.mask_input,
  )


def init_from(config: ml_collections.ConfigDict, target: llama.LlamaConfig) -> str | None:
  """The drafter directory `train.init_from` names, or None when it is empty.

  `shipped` is the drafter of the config's kind shipped for the target. The drafter's
  `drafter.json` alone is checked against the config's drafter (everything but its trees and
  dtypes must agree), before anything is loaded or compiled.
  """
  spec = config.train.init_from
  if not spec:
    return None
  kind = config.drafter.kind
  directory = drafter_files.shipped_drafter(target.name, kind) if spec == "shipped" else spec
  if directory is None:
    raise ValueError(f"train.init_from=shipped: no {kind} drafter ships for {target.name!r}")
  try:
    have = drafter_files.read_drafter_config(directory, target, as_stored=True)
  except ValueError as e:
    raise ValueError(f"train.init_from: {e}") from None
  want = drafter_config(config, target)
  for field in dataclasses.fields(want):
    mine, theirs = getattr(want, field.name), getattr(have, field.name)
    if field.name not in _FREE_FIELDS and mine != theirs:
      raise ValueError(
        f"train.init_from: the drafter in {directory} has {field.name}={theirs}, the config's "
        f"drafter {mine}: they must be the same"
      )
  return directory


def initialize_cluster(cluster) -> None:
  """`jax.distributed.initialize`, with the cluster config's settings where they are given."""
  import jax

  given = dict(
    coordinator_address=cluster.coordinator_address or None,
    num_processes=cluster.num_processes or None,
    process_id=cluster.process_id if cluster.process_id >= 0 else None,
  )
  if cluster.coordinator_address and None in given.values():
    raise ValueError(
      "cluster.coordinator_address needs cluster.num_processes and cluster.process_id"
    )
  if given["process_id"] is not None and given["process_id"] >= (cluster.num_processes or 1):
    raise ValueError(
      f"cluster.process_id={cluster.process_id} must be below "
      f"cluster.num_processes={cluster.num_processes}"
    )
  jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None})


def step_config(config: ml_collections.ConfigDict, scan_layers: bool = True):
  """The train step's config from a training config, its values checked (one ValueError)."""
  from pspec_jax import losses
  from train.step import OptimizerConfig, StepConfig

  target = target_config(config, scan_layers)
  t = config.train
  for name in ("batch_size", "log_every", "eval_every", "eval_batches", "checkpoint_every"):
    if t[name] < 1:
      raise ValueError(f"train.{name}={t[name]}: it must be >= 1")
  if config.data.seq_len < 2:
    raise ValueError(f"data.seq_len={config.data.seq_len}: it must be >= 2 (a token and its next)")
  if t.keep_checkpoints < 1:
    raise ValueError(f"train.keep_checkpoints={t.keep_checkpoints}: keep at least 1")
  return StepConfig(
    target=target,
    drafter=drafter_config(config, target),
    loss=losses.LossConfig(**config.loss.to_dict()),
    optimizer=OptimizerConfig(
      lr=t.lr,
      warmup_steps=t.warmup_steps,
      steps=t.steps,
      end_lr_ratio=t.end_lr_ratio,
      weight_decay=t.weight_decay,
      clip_norm=t.clip_norm,
    ),
    microbatches=t.microbatches,
    cached_features=config.data.cache_features,
  )
