r"""Train a drafter by distillation from its frozen target (docs/design.md section 4).

  python -m train.distill --config=configs/smollm2_135m.py --workdir=workdirs/smollm2_pspec
  python -m train.distill --config=configs/llama2_13b.py --workdir=gs://bucket/run
  python -m train.distill --config=configs/llama2_13b.py --dry_run   # memory plan only

The workdir holds orbax checkpoints (`checkpoints/`), `metrics.jsonl`, TensorBoard event files
(`tb/`) and, at the end, the drafter in the engine's file format (`export/`). Restarted with
the same workdir, a run resumes from its last complete checkpoint at the same step and data
position, from the newest checkpoint that reads back whole (a damaged newer one is skipped,
named, and moved to `checkpoints_damaged/`). A step whose loss, gradient or update is NaN or
Inf stops the run without keeping that step: every checkpoint and export holds finite weights.
`--config.train.init_from=DIR` (or `shipped`) starts a fresh workdir from an exported drafter
instead of random weights, e.g. to fine-tune the shipped one on other data (with `--eval_only`:
score it on the held-out split first).
"""

import json
import os
import time

from absl import flags
from ml_collections import config_flags

from pspec_jax import cli

FLAGS = flags.FLAGS


def _scalars(metrics: dict, prefix: str = "") -> dict:
  """Flattens metrics (per-depth vectors become `name/d1`, ...) into floats."""
  import numpy as np

  out = {}
  for name, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 0:
      out[prefix + name] = float(value)
    else:
      out.update({f"{prefix}{name}/d{i + 1}": float(v) for i, v in enumerate(value)})
  return out


def workdir_path(workdir: str):
  """The workdir as an `epath.Path`: local paths made absolute, URLs (gs://...) kept."""
  from etils import epath

  return epath.Path(workdir if "://" in workdir else os.path.abspath(workdir))


def train(config, workdir: str, eval_only: bool = False) -> None:
  import dataclasses

  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils
  from tqdm import tqdm

  from pspec_jax import checkpoints, data, sharding
  from pspec_jax.drafter import Drafter
  from pspec_jax.drafter_files import load_drafter, save_drafter
  from train import build, features, metrics_log, resume
  from train import step as step_lib

  cfg = build.step_config(config)
  build.check_target_exists(config)
  if config.distributed:
    build.initialize_cluster(config.cluster)
    if config.data.cache_features:
      raise ValueError("data.cache_features is for one host: set it False on a multi-host run")
  main = jax.process_index() == 0
  t = config.train
  if t.batch_size % (jax.process_count() * t.microbatches):
    raise ValueError(
      f"train.batch_size={t.batch_size} must divide over {jax.process_count()} hosts and "
      f"train.microbatches={t.microbatches}"
    )
  check_workdir(workdir)
  manager = ocp.CheckpointManager(
    workdir_path(workdir) / "checkpoints",
    options=ocp.CheckpointManagerOptions(
      max_to_keep=t.keep_checkpoints,
      save_interval_steps=t.checkpoint_every,
      enable_async_checkpointing=True,
    ),
  )
  start = manager.latest_step()  # the newest step on disk; it may not restore (resume.py)
  # A run that resumes has its own weights: it needs no starting drafter, not even to exist.
  init_dir = build.init_from(config, cfg.target) if start is None else None
  if eval_only and start is None and not init_dir:
    raise ValueError(f"{workdir} has no checkpoint to evaluate (nor a train.init_from)")

  # Data first: bad data is reported before the model is loaded or anything compiled.
  tokenizer = checkpoints.load_tokenizer(config.target.checkpoint)
  source = config.data.source
  if source == config.selfdistill.out and not os.path.exists(source):
    raise ValueError(f"{source} does not exist: run `python -m train.selfdistill` first")
  loaded = {
    split: data.load_token_data(
      source,
      tokenizer,
      seq_len=config.data.seq_len,
      split=split,
      heldout_per_mille=config.data.heldout_per_mille,
      max_conversations=config.data.max_conversations,
      packed=config.data.packed,
      cache_dir=config.data.cache_dir or None,
      tfds_data_dir=config.data.tfds_data_dir or None,
      skip_malformed=config.data.skip_malformed,
    )
    for split in ("train", "heldout")
  }
  if config.data.mask_loops:
    loaded = {split: data.mask_loops(d) for split, d in loaded.items()}

  mesh = sharding.make_mesh(**config.mesh.to_dict())
  place = step_lib.placement(cfg, mesh)
  target = build.load_target(config)
  target_params = jax.device_put(target.params, place.target)
  if config.data.cache_features:
    cache_dir = config.data.cache_dir or data.default_cache_dir()
    for split in loaded:
      stored = features.target_features(
        loaded[split], target, cache_dir, t.batch_size, cfg.drafter.feature_layers
      )
      loaded[split] = dataclasses.replace(loaded[split], features=stored)
  train_step = step_lib.jit_train_step(cfg, place)
  eval_step = step_lib.jit_eval_step(cfg, place)
  key = jax.random.key(config.seed)
  if init_dir:
    initial = load_drafter(init_dir, target, as_stored=True)
    vocab = initial.vocab
    state = step_lib.jit_init_from(cfg, place)(initial.params, vocab)
    if main:
      print(f"starting from the drafter in {init_dir}", flush=True)
  else:
    vocab = None
    if cfg.drafter.draft_vocab_size:
      vocab = data.frequent_tokens(loaded["train"], cfg.drafter.draft_vocab_size)
    state = step_lib.jit_init(cfg, place)(jax.random.fold_in(key, 1), vocab)
  if start is not None:
    restored = resume.restore_newest(manager, sharding.abstract(state, place.state), main=main)
    if main:
      for why in restored.skipped:
        print(f"skipped the damaged checkpoint at {why}", flush=True)
      if restored.skipped:
        aside = workdir_path(workdir) / "checkpoints_damaged"
        print("(deleted)" if "://" in workdir else f"(moved to {aside})", flush=True)
    start, state = restored.step, restored.state
    if main:
      position = restored.meta["data_position"]
      print(f"resumed from step {start} (data position {position})", flush=True)
  first = int(state.step)
  if cfg.drafter.draft_vocab_size:
    if start is not None:
      # A resumed run keeps its checkpoint's vocabulary, chosen from the data it started on,
      # even if the data has grown since.
      vocab = multihost_utils.process_allgather(state.draft_vocab, tiled=True)
    coverage = {s: data.coverage(loaded[s], vocab) for s in loaded}
    if main:
      if start is not None:
        which = "the checkpoint's {} tokens"
      elif init_dir:
        which = "the starting drafter's {} tokens"
      else:
        which = "the {} most frequent tokens"
      print(
        f"draft vocabulary: {which.format(len(vocab))} cover {coverage['train']:.1%} of "
        f"the training and {coverage['heldout']:.1%} of the held-out answers",
        flush=True,
      )

  def global_batch(split: str, index: int) -> dict:
    """Batch `index` of a split; each host contributes its slice of the global batch."""
    batch = loaded[split].batch(index, t.batch_size, seed=config.seed)
    per_host = t.batch_size // jax.process_count()
    lo = jax.process_index() * per_host
    return {
      name: jax.make_array_from_process_local_data(
        place.batch[name], batch[name][lo : lo + per_host]
      )
      for name in step_lib.batch_keys(cfg)
    }

  log = metrics_log.MetricsLog(workdir, active=main)
  if main:
    log.text(
      "config",
      json.dumps(dict(config=config.to_dict(), train_conversations=len(loaded["train"]))),
    )

  def evaluate(done: int) -> dict[str, float]:
    evals = [
      eval_step(state, target_params, global_batch("heldout", i), key)
      for i in range(t.eval_batches)
    ]
    scalars = _scalars(jax.tree.map(lambda *xs: np.mean(xs, axis=0), *jax.device_get(evals)))
    log.write(done, {f"eval/{k}": v for k, v in scalars.items()})
    return scalars

  if eval_only:
    scalars = evaluate(first)
    if main:
      print(f"held-out at step {first}: " + json.dumps(scalars), flush=True)
    log.close()
    manager.close()
    return
  bar = tqdm(total=t.steps, initial=first, desc=f"distill {cfg.drafter.kind}", disable=not main)
  tokens_per_step = t.batch_size * config.data.seq_len
  last_time = time.perf_counter()
  for step in range(first, t.steps):
    batch = global_batch("train", step)
    state, metrics = train_step(state, target_params, batch, key)
    loss = float(metrics["loss"])
    if not bool(metrics["finite"]):
      bar.close()  # the error line below starts a line of its own
      manager.wait_until_finished()
      blamed = None
      if not bool(metrics["finite_gradient"]) and manager.latest_step() == step:
        # The checkpoint holds the very weights whose loss or gradient is not finite: a
        # restart from it would fail on this batch at any learning rate.
        blamed = step
        resume.set_aside(manager, step, main)
      raise FloatingPointError(diverged_message(step + 1, loss, manager.latest_step(), blamed))
    done = step + 1
    manager.save(
      done,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({"step": done, "data_position": done * t.batch_size}),
      ),
    )
    bar.update(1)
    if done % t.log_every == 0 or done == t.steps:
      now = time.perf_counter()
      scalars = _scalars({k: v for k, v in metrics.items() if not k.startswith("finite")})
      scalars["tokens_per_s"] = (
        tokens_per_step * (done - max(first, done - t.log_every)) / (now - last_time)
      )
      last_time = now
      log.write(done, scalars)
      bar.set_postfix(loss=f"{loss:.3f}", agree1=f"{scalars.get('agree_per_depth/d1', 0):.2f}")
    if done % t.eval_every == 0 or done == t.steps:
      evaluate(done)
      last_time = time.perf_counter()
  bar.close()
  manager.wait_until_finished()
  manager.close()
  # Every process joins the gather (a drafter sharded over hosts); process 0 writes it.
  params, vocab = multihost_utils.process_allgather((state.params, state.draft_vocab), tiled=True)
  if main:
    save_drafter(
      workdir_path(workdir) / "export",
      Drafter(cfg=cfg.drafter, params=params, vocab=vocab),
      extra={"trained_steps": int(state.step), "config": config.to_dict()},
      dtype=build.storage_dtype(config.drafter.export_dtype),
    )
  log.close()


def diverged_message(step: int, loss: float, last_saved: int | None, blamed: int | None) -> str:
  """What a run that stopped on a non-finite step says: nothing of that step was kept."""
  why = f"step {step} gave a non-finite loss, gradient or update (loss {loss})"
  why += ": stopped without keeping it"
  if blamed is not None:
    why += f". The checkpoint at step {blamed}, whose weights gave it, is set aside"
    why += " (checkpoints_damaged/)"
  kept = (
    f"the last checkpoint (step {last_saved}) holds finite weights and a restart resumes from it"
    if last_saved is not None
    else "no checkpoint is left, so a restart starts afresh"
  )
  return f"{why}; {kept}. Lower train.lr (or raise train.warmup_steps), or check the data"


def check_workdir(workdir: str) -> None:
  """A local workdir (and its `checkpoints/`) must be a directory, or not exist yet."""
  if "://" in workdir:
    return
  for path in (workdir, os.path.join(workdir, "checkpoints")):
    if os.path.exists(path) and not os.path.isdir(path):
      raise ValueError(f"--workdir: {path} is a file, not a directory: give a directory")


def dry_run(config) -> None:
  """Prints per-device bytes of everything a train step holds, for the configured mesh."""
  from train import build, plan

  cfg = build.step_config(config)
  print(plan.memory_table(config, cfg), flush=True)
  print(plan.compiled_memory(config, cfg))


def main():
  config = FLAGS.config
  if FLAGS.dry_run:
    dry_run(config)
    return
  workdir = FLAGS.workdir or config.workdir
  if not workdir:
    raise ValueError("give --workdir (or config.workdir)")
  train(config, workdir, eval_only=FLAGS.eval_only)


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
  flags.mark_flags_as_required(["config"])
  flags.DEFINE_string("workdir", None, "Checkpoints, metrics and the export (default: config).")
  flags.DEFINE_bool(
    "dry_run", False, "Print the per-device memory plan and exit; allocates nothing."
  )
  flags.DEFINE_bool(
    "eval_only",
    False,
    "Evaluate the workdir's last checkpoint (or, in a fresh workdir, the train.init_from "
    "drafter) on the held-out split and exit.",
  )


if __name__ == "__main__":
  cli.run(main, define_flags)
