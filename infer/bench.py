r"""Speedup and acceptance length of every decoding method on real prompt sets, in one run.

  python -m infer.bench                                   # configs/bench_default.py
  python -m infer.bench --config.methods=none,pspec --config.datasets=mt_bench,humaneval
  python -m infer.bench --config=configs/bench_default.py:ablation   # K = 1..4, chain trees
  python -m infer.bench --config.temperature=0,1 --config.batch_size=1,4

Settings (method, dataset, temperature, batch size, K, tree) are run a family (same dataset,
temperature and batch size) at a time: every setting of the family is compiled and warmed up
first, then they are interleaved prompt batch by prompt batch, so machine noise hits all of them
alike; the family's compiled programs are dropped before the next. Per setting it records
tokens/s, the speedup over `none` measured in the same run, tau (tokens per target pass),
per-depth acceptance, the share of a round spent drafting, verifying and accepting +
committing (from a few prompts run phase by phase), at temperature 0 whether every output
equals `none`'s token for token (the lossless check), and for an adaptive tree how often each
candidate was chosen. An adaptive tree's round costs come from this machine's calibration
(`infer.calibration`, measured at the first run that needs them).

Methods: `none` (plain decoding), `pld`, `medusa`, `eagle`, `pspec` (pspec_jax.decode with the
shipped drafters or those under `drafter_dir`), and `hf` / `hf_pld` (HF transformers' PyTorch
`generate` on the same weights in the same dtype, plain and with prompt lookup, on a CUDA GPU
when JAX runs on one; batch size 1, and only when torch is installed).

This program parses the settings and runs them; the runners and the measurement are
`infer.measure`'s, report.md and the plots `infer.report`'s, and `--dry_run`'s memory plan
`infer.plan`'s.
"""

import dataclasses
import datetime
import importlib.util
import json
import os
import platform

import jax
import jax.numpy as jnp
from absl import flags
from ml_collections import config_flags

from infer import calibration, measure, plan, report
from pspec_jax import checkpoints, cli, decode, drafter_files, sharding, tree_specs
from pspec_jax import prompts as prompts_lib


def _values(value, kind) -> list:
  """A config list: "0,1" or a single number; "" is [""] for string lists (the default)."""
  parts = [p.strip() for p in str(value).split(",")] if value != "" else [""]
  if kind is str:
    return parts
  try:
    return [kind(p) for p in parts if p]
  except ValueError:
    raise ValueError(f"expected comma-separated {kind.__name__}s, got {value!r}") from None


def check_config(config) -> tuple[list, list, list, list, list, list]:
  """Everything the config says that needs no model, checked the same way by a run and by
  `--dry_run`: (methods, temperatures, batch sizes, Ks, trees, draft rules)."""
  if min(config.num_prompts, config.max_new_tokens, config.turns) < 1:
    raise ValueError("num_prompts, max_new_tokens and turns must be >= 1")
  methods = _values(config.methods, str)
  known = measure.OUR_METHODS + measure.HF_METHODS
  unknown = sorted(set(methods) - set(known))
  if unknown or methods == [""]:
    raise ValueError(f"unknown methods {unknown}: known are {', '.join(known)}")
  for name in _values(config.datasets, str):
    if name not in prompts_lib.PROMPT_SETS:
      raise ValueError(f"unknown dataset {name!r}: known are {', '.join(prompts_lib.PROMPT_SETS)}")
  temperatures = _values(config.temperature, float)
  batch_sizes = _values(config.batch_size, int)
  ks = _values(config.num_draft, int) or [0]
  trees = _values(config.tree, str)
  if not temperatures or not batch_sizes:
    raise ValueError("give at least one temperature and one batch size")
  rules = _values(config.get("drafts", "sampled"), str)
  if not rules or set(rules) - set(decode.DRAFTS):
    raise ValueError(f"unknown drafts {config.drafts!r}: use {', '.join(decode.DRAFTS)}")
  if any(t < 0 for t in temperatures) or any(b < 1 for b in batch_sizes) or min(ks) < 0:
    raise ValueError("temperatures must be >= 0, batch sizes >= 1 and num_draft >= 0")
  for tree in trees:
    if tree and tree != "fixed":  # `fixed`: each drafter's own
      tree_specs.parse(tree, 64)  # the spelling; depth is checked per drafter below
  if config.out and os.path.exists(config.out) and not os.path.isdir(config.out):
    raise ValueError(f"out: {config.out} is a file, not a directory: give a directory")
  return methods, temperatures, batch_sizes, ks, trees, rules


def settings_of(config, target, drafters: dict) -> tuple[list[measure.Setting], list[str]]:
  """Every setting the config asks for, and why any combination was left out."""
  methods, temperatures, batch_sizes, ks, trees, rules = check_config(config)
  out, skipped = [], []
  for dataset in _values(config.datasets, str):
    for temperature in temperatures:
      for batch in batch_sizes:
        for method in ["none"] + [m for m in methods if m != "none"]:
          if method in measure.HF_METHODS or method == "none":
            if method in measure.HF_METHODS and batch != 1:
              skipped.append(f"{method} at batch size {batch}: HF is measured at batch size 1")
              continue
            out.append(measure.Setting(method, dataset, temperature, batch, 0, ""))
            continue
          drafter = drafters[method]
          for k in ks:
            for tree in trees:
              name = drafter.cfg.tree_for(temperature == 0, tree)
              cfg = decode.DecodeConfig(num_draft=k, tree=name)
              try:
                decode.check_drafter(target, drafter)
                decode.make_plan(cfg, drafter, 1)  # the tree within what the drafter proposes
              except ValueError as e:
                skipped.append(f"{method} K={k or drafter.cfg.num_draft} tree {name}: {e}")
                continue
              own = drafter.cfg.num_draft
              if k and k != own and tree_specs.parse(name, k) == tree_specs.parse(name, own):
                # The row would say K=k and decode the drafter's own K: not a setting.
                skipped.append(f"{method} K={k} tree {name}: the tree fixes its own depth")
                continue
              for rule in rules:
                setting = measure.Setting(
                  method, dataset, temperature, batch, k or drafter.cfg.num_draft, name, rule
                )
                drawn = dataclasses.replace(setting, drafts="sampled").decode_config(**_SHAPELESS)
                if not decode.make_plan(drawn, drafter, 1).drawn:
                  setting = dataclasses.replace(setting, drafts="")  # the rule changes nothing
                if setting not in out:
                  out.append(setting)
  return out, skipped


_SHAPELESS = dict(max_new_tokens=1, eos_ids=(), pad_id=0)


def dry_run(config) -> str:
  """The memory plan of the configured decoding (the largest batch, tree and K asked for)."""
  methods, _, batch_sizes, ks, trees, _ = check_config(config)
  dtype = jnp.dtype(config.dtype)
  target = checkpoints.load_target_config(
    config.target, dtype=dtype, param_dtype=dtype, scan_layers=False
  )
  return plan.decode_plan(
    target,
    [m for m in methods if m in ("medusa", "eagle", "pspec")],
    num_draft=max(ks) or 4,
    trees=trees,
    batch=max(batch_sizes),
    prompt_width=prompts_lib.bucket(config.max_prompt_tokens),
    max_new_tokens=config.max_new_tokens,
    hardware=config.hardware,
    mesh=sharding.parse_mesh(config.mesh),
  )


def run(config, progress=True) -> dict:
  methods = check_config(config)[0]
  if any(m in measure.HF_METHODS for m in methods):
    # On a GPU, torch's copy of the target shares the card: JAX takes memory as it needs it
    # instead of 75% up front (effective when JAX has not started yet, as in a program).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if importlib.util.find_spec("torch") is None:
      raise ValueError("methods hf and hf_pld need torch: pip install -e '.[test]'")
  tokenizer = checkpoints.load_tokenizer(config.target)
  prompts = {
    name: measure.encode_prompts(
      tokenizer,
      prompts_lib.prompt_set(name),
      source=f"dataset {name!r}",
      count=config.num_prompts,
      max_tokens=config.max_prompt_tokens,
    )
    for name in _values(config.datasets, str)
  }
  mesh = sharding.make_mesh(**sharding.parse_mesh(config.mesh)) if config.mesh else None
  dtype = jax.numpy.dtype(config.dtype)
  target = checkpoints.load_target(
    config.target,
    dtype=dtype,
    param_dtype=dtype,
    scan_layers=False,
    untie_head=True,
    weight_layout=config.weight_layout,
    mesh=mesh,
    gguf_blocks=config.gguf_blocks,
  )
  drafters, drafter_meta = {}, {}
  for method in methods:
    if method in ("pld", "medusa", "eagle", "pspec"):
      spec = None
      if method != "pld":
        spec = os.path.join(config.drafter_dir, method) if config.drafter_dir else None
        spec = spec or drafter_files.shipped_drafter(target.cfg.name, method)
      drafters[method] = drafter_files.resolve_drafter(method, spec, target)
      drafter_meta[method] = _drafter_meta(drafters[method], spec)
  if mesh is not None:
    drafters = {m: decode.shard(mesh, target, d)[1] for m, d in drafters.items()}
  settings, skipped = settings_of(config, target, drafters)
  eos_ids = checkpoints.eos_token_ids(config.target, tokenizer)
  pad_id = tokenizer.pad_token_id or 0

  def decode_config(s: measure.Setting) -> decode.DecodeConfig:
    return s.decode_config(
      max_new_tokens=config.max_new_tokens,
      eos_ids=eos_ids,
      pad_id=pad_id,
      mesh=mesh,
      sampled_eos=config.sampled_eos,
    )

  def costs(s: measure.Setting, cfg, width: int) -> tuple:
    """An adaptive tree's round costs on this machine (measured once, in the program that
    decodes the dataset's prompts, then read back)."""
    drafter = drafters.get(s.method)
    if drafter is None or not decode.resolve_tree(cfg, drafter).candidates:
      return ()
    first = prompts[s.dataset][0]
    return calibration.costs_for(target, drafter, cfg, s.batch_size, first, width)

  runners = {}
  for s in settings:
    if s.method in measure.HF_METHODS:
      runners[s] = measure.HFMethod(
        config.target,
        decode_config(s),
        config.torch_threads,
        prompt_lookup=s.method == "hf_pld",
        dtype=config.dtype,
        same_model=not target.keeps_blocks,
      )
    else:
      width = prompts_lib.bucket(max(map(len, prompts[s.dataset])))
      cfg = decode_config(s)
      cfg = dataclasses.replace(cfg, costs=costs(s, cfg, width))
      runners[s] = measure.OurMethod(target, drafters.get(s.method), cfg, pad_id, width)

  def time_split(s: measure.Setting) -> dict[str, float] | None:
    if s.method not in measure.OUR_METHODS or not config.phase_prompts:
      return None
    head = prompts[s.dataset][: config.phase_prompts]
    return measure.phase_shares(target, drafters.get(s.method), head, decode_config(s))

  rows = measure.measure(
    settings, runners, prompts, config.seed, time_split, progress, turns=config.turns
  )

  meta = dict(
    machine=platform.platform(),
    processor=platform.processor() or platform.machine(),
    cpu_count=os.cpu_count(),
    devices=[str(d) for d in jax.devices()],
    platform=jax.default_backend(),
    device_kind=jax.devices()[0].device_kind,
    jax_version=jax.__version__,
    target=config.target,
    drafters=drafter_meta,
    config=config.to_dict(),
    skipped=skipped,
  )
  if config.step_profile and "none" in methods:
    first = next(iter(prompts.values()))[0]
    meta.update(measure.step_profile(target, first, decode_config(settings[0])))
  return dict(meta=meta, rows=rows)


def _drafter_meta(drafter, directory: str | None) -> dict:
  c = drafter.cfg
  meta = dict(
    kind=c.kind,
    num_draft=c.num_draft,
    tree=c.tree_for(greedy=True),
    sampling_tree=c.tree_for(greedy=False),
    source=directory,
  )
  if directory:
    with open(os.path.join(directory, drafter_files.CONFIG_FILE)) as fh:
      meta.update(trained_steps=json.load(fh).get("trained_steps"))
    meta.update(draft_vocab_size=c.draft_vocab_size)
  return meta


def main():
  config = flags.FLAGS.config
  if flags.FLAGS.dry_run:
    print(dry_run(config))
    return
  results = run(config)
  out = config.out or os.path.join(
    "bench_results", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  )
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as fh:
    json.dump(results, fh, indent=2)
  text = report.report(results)
  with open(os.path.join(out, "report.md"), "w") as fh:
    fh.write(text)
  report.plots(results, out)
  print(text)
  print(f"results in {out}/")


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "bench_default.py")
  )
  flags.DEFINE_bool(
    "dry_run",
    False,
    "Print per-device memory of decoding on config.mesh and config.hardware; allocates nothing.",
  )


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
