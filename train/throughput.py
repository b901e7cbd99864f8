r"""Training throughput of a distillation config with COD keep ratios against all mask slots.

  python -m train.throughput --config=configs/smollm2_135m.py --config.drafter.num_draft=8
  python -m train.throughput --config=configs/smollm2_135m.py --keep=1/0,0.7/0.2,0.5/0.1

Times the config's train step (its batch, sequence length, drafter and loss) once per keep
ratio/floor pair (`LossConfig.keep_ratio`, `keep_floor`; 1/0 is every slot of every anchor), on
random weights and tokens, interleaved so that the machine's drift spreads over every variant,
after compilation. Prints per variant the mask-slot rows a step trains, the median step time,
answer tokens per second and the speed against the first variant.
"""

import functools
import statistics
import time

from absl import flags
from ml_collections import config_flags

from pspec_jax import cli

FLAGS = flags.FLAGS


def parse_keep(values: list[str]) -> list[tuple[float, float]]:
  """`ratio/floor` pairs; one ValueError naming the bad one."""
  out = []
  for value in values:
    try:
      ratio, floor = (float(x) for x in value.split("/"))
    except ValueError:
      raise ValueError(f"--keep: {value!r} is not ratio/floor (e.g. 0.7/0.2)") from None
    out.append((ratio, floor))
  return out


def main():
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  from pspec_jax import drafter as drafter_lib
  from pspec_jax import llama
  from train import build
  from train import step as step_lib

  keeps = parse_keep(FLAGS.keep)
  if FLAGS.repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {FLAGS.repeats}")
  config = FLAGS.config
  base = dataclasses.replace(build.step_config(config), cached_features=True)
  variants = [
    dataclasses.replace(base, loss=dataclasses.replace(base.loss, keep_ratio=r, keep_floor=f))
    for r, f in keeps
  ]
  tcfg, dcfg = base.target, base.drafter
  batch_size, seq_len = config.train.batch_size, config.data.seq_len
  rng = np.random.default_rng(0)
  vocab = dcfg.draft_vocab_size or tcfg.vocab_size
  batch = dict(
    tokens=jnp.asarray(rng.integers(0, vocab, (batch_size, seq_len)), jnp.int32),
    loss_mask=jnp.asarray(np.arange(seq_len)[None] >= seq_len // 16).repeat(batch_size, 0),
    segments=jnp.ones((batch_size, seq_len), jnp.int32),
    features=jnp.asarray(
      rng.normal(size=(batch_size, seq_len, dcfg.feature_width)), tcfg.param_dtype
    ),
  )
  target_params = llama.init_params(tcfg, jax.random.key(0))
  params = drafter_lib.init_params(dcfg, jax.random.key(1))
  draft_vocab = jnp.arange(vocab, dtype=jnp.int32) if dcfg.draft_vocab_size else None
  runs = []
  for cfg in variants:
    fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg))
    state = step_lib.init_state(cfg, params, draft_vocab)
    state, metrics = fn(state, target_params, batch, jax.random.key(0))  # compiles
    jax.block_until_ready(metrics)
    runs.append([fn, state, float(metrics["tokens"]), []])
  for rep in range(FLAGS.repeats):
    for run in runs:
      fn, state = run[0], run[1]
      start = time.perf_counter()
      state, metrics = fn(state, target_params, batch, jax.random.key(rep + 1))
      jax.block_until_ready(metrics)
      run[3].append(time.perf_counter() - start)
      run[1] = state
  slots = dcfg.num_draft - 1 if dcfg.kind == "pspec" else 0
  print(
    f"{dcfg.kind} K={dcfg.num_draft}, batch {batch_size} x {seq_len}, "
    f"{base.loss.anchors or 'every'} anchors, median of {FLAGS.repeats} steps"
  )
  first = statistics.median(runs[0][3])
  for (ratio, floor), cfg, (_, _, tokens, times) in zip(keeps, variants, runs, strict=True):
    rows = batch_size * sum(cfg.loss.kept_anchors(cfg.loss.anchors or seq_len, slots))
    t = statistics.median(times)
    print(
      f"keep {ratio:g}/{floor:g}: {rows:6d} slot rows/step, step {t * 1000:8.1f} ms, "
      f"{tokens / t:8.1f} answer tokens/s, {first / t:.2f}x the first"
    )


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
  flags.mark_flags_as_required(["config"])
  flags.DEFINE_list("keep", ["1/0", "0.7/0.2", "0.5/0.1"], "COD keep ratio/floor pairs.")
  flags.DEFINE_integer("repeats", 6, "Timed steps per variant.")


if __name__ == "__main__":
  cli.run(main, define_flags)
