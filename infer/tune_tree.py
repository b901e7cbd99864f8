r"""Tune the token tree to a drafter and a device: the tree of most tokens per second.

  python -m infer.tune_tree                       # the shipped pspec drafter, embedded target
  python -m infer.tune_tree --write               # ... and store the choice in its drafter.json
  python -m infer.tune_tree --method=eagle --sizes=2,4,8,16 --num_prompts=16 --out=eagle.json

Three measurements, then a choice per temperature. First the static tree (the calibration of
Medusa's and Sequoia's trees, measured):
1. Acceptance. The calibration prompts are decoded greedily with a wide tree (`--pool` nodes,
   grown under `tree.RANK_PRIOR`), counting for every rank path how often its node lies on the
   accepted path. Under greedy acceptance a node is accepted exactly when its tokens and its
   ancestors' match the target's, whatever else the tree holds, so these rates give the
   expected tokens per round of every subtree: `tree.best` builds the best one of N nodes.
2. Cost. One whole round (verify, accept+commit, draft) with each of those trees, and one
   plain auto-regressive round, timed on this device after compilation, taking turns round
   by round (medians).
Expected speedup = tokens per round x plain round time / round time, at temperature 0.
3. End to end. A gate (`+min:P`: draft only when the drafter is that confident) and a prompt-
   lookup chain (`+lookup:L`) make a round's cost depend on the text, so the fastest static
   tree, with and without a chain, gated at each `--gates` P, and the chain alone, are decoded
   over the calibration prompts at each `--temperatures` T against plain decoding, interleaved
   prompt by prompt (`infer.measure`, as `infer.bench` measures), and the fastest is chosen per
   temperature.
The tool prints the tables and the `--tree` flags (`infer.generate`, `infer.bench`); `--write`
stores the choices as the drafter's own trees in its drafter.json, for this kind of device
(`device_trees.<cpu|gpu|tpu>`: `tree` at T = 0, `sampling_tree` above). Calibration prompts
default to ShareGPT's held-out split, so a benchmark on MT-Bench stays out of sample.
"""

import dataclasses
import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from infer import measure
from pspec_jax import checkpoints, cli, decode, drafter_files
from pspec_jax import drafter as drafter_lib
from pspec_jax import prompts as prompts_lib
from pspec_jax import tree as tree_lib

FLAGS = flags.FLAGS


def acceptance_rates(target, drafter, prompts, cfg, batch_size):
  """How often each rank path of the pool `cfg.tree` is accepted, per round; and the rounds."""
  pool = decode.resolve_tree(cfg, drafter)

  # The weights are arguments, not constants of the program (XLA would fold them in).
  @functools.partial(jax.jit, static_argnums=0)
  def calibration_round(plan, target, drafter, state):
    # decode.round_step's three steps, keeping the path that commit accepts.
    verified = decode.verify(plan, target, drafter, state)
    path_BP1, num_accepted_B, _ = decode.accept_path(plan, state, verified)
    after, pairs = decode.commit(plan, state, verified)
    after = decode.draft(plan, target, drafter, after, pairs)
    # Count what the round kept, as decoding's own statistics do: the accepted path, cut at an
    # EOS or the token budget; nothing for finished sequences.
    kept_B = after.num_tokens - state.num_tokens
    on_path = jnp.arange(pool.depth + 1)[None, :] < jnp.minimum(kept_B, num_accepted_B + 1)[:, None]
    hits_M = jnp.zeros(pool.num_nodes, jnp.int32).at[path_BP1].add(on_path.astype(jnp.int32))
    return after, hits_M, (~state.done).sum()

  hits, rounds = np.zeros(pool.num_nodes, np.int64), 0
  for start in range(0, len(prompts), batch_size):
    tokens, lengths = prompts_lib.pad_batch(prompts[start : start + batch_size])
    plan = decode.make_plan(cfg, drafter, tokens.shape[1])
    state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
    while not bool(state.done.all()):
      state, hits_M, active = calibration_round(plan, target, drafter, state)
      hits += np.asarray(hits_M)
      rounds += int(active)
  rates = {p: hits[i + 1] / max(rounds, 1) for i, p in enumerate(pool.paths)}
  return rates, rounds


def round_costs(target, ids, runs, repeats):
  """Median ms of one whole decoding round for each (cfg, drafter) of `runs`, at the prompt.

  The runs take turns round by round, so machine noise hits them alike; each first compiles
  and runs two warm-up rounds.
  """
  tokens, lengths = prompts_lib.pad_batch([ids])
  key = jax.random.key(0)
  plans = [decode.make_plan(cfg, drafter, tokens.shape[1]) for cfg, drafter in runs]
  states = [
    decode.init(plan, target, drafter, tokens, lengths, key)
    for plan, (_, drafter) in zip(plans, runs, strict=True)
  ]
  times = [[] for _ in runs]
  for _ in range(repeats + 2):
    for i, (plan, (_, drafter)) in enumerate(zip(plans, runs, strict=True)):
      states[i], seconds = measure.timed(decode.round_step, plan, target, drafter, states[i])
      times[i].append(seconds)
  return [1e3 * statistics.median(t[2:]) for t in times]


def tune(
  target, drafter, prompts, *, pool_nodes, sizes, max_new_tokens, eos_ids, repeats, batch_size
):
  """Measures acceptance and round costs; returns the table (one row per tree size) and rounds.

  Rows: nodes (root included), tree spec, expected tokens per round, ms per round, expected
  speedup over plain decoding (the row with 1 node is plain decoding itself).
  """
  num_draft = drafter.cfg.num_draft
  pool = tree_lib.Tree(paths=tree_lib.grow(pool_nodes, num_draft))
  cfg = decode.DecodeConfig(
    max_new_tokens=max_new_tokens, eos_ids=eos_ids, num_draft=num_draft, tree=pool.spec
  )
  decode.check_drafter(target, drafter)
  rates, rounds = acceptance_rates(target, drafter, prompts, cfg, batch_size)
  trees = []
  for n in sorted(set(sizes)):
    tree = tree_lib.best(rates, min(n, pool.num_nodes))
    if tree.num_nodes >= 2 and tree not in trees:
      trees.append(tree)
  # Timed rounds run in a cache as long as decoding's and never stop early: no EOS, and a
  # budget past the last timed round.
  budget = max(max_new_tokens, (repeats + 3) * (num_draft + 1))
  timing = dataclasses.replace(cfg, eos_ids=(), max_new_tokens=budget)
  runs = [(dataclasses.replace(timing, tree=""), None)]
  runs += [(dataclasses.replace(timing, tree=t.spec), drafter) for t in trees]
  plain_ms, *tree_ms = round_costs(target, prompts[0], runs, repeats)
  rows = [dict(nodes=1, tree="", tokens_per_round=1.0, ms=plain_ms, speedup=1.0)]
  for tree, ms in zip(trees, tree_ms, strict=True):
    tokens = tree_lib.expected_tokens(tree, rates)
    rows.append(
      dict(
        nodes=tree.num_nodes,
        tree=tree.spec,
        tokens_per_round=tokens,
        ms=ms,
        speedup=tokens * plain_ms / ms,
      )
    )
  return rows, rounds


def tree_candidates(static_tree: str, gates: list[float], lookup: int) -> list[str]:
  """Stage 3's trees: the static tree alone, with a lookup chain of `lookup` (0: none), gated at
  each of `gates`, and the chain alone."""
  chain = f"+lookup:{lookup}" if lookup else ""
  out = [static_tree] + ([static_tree + chain] if lookup else [])
  out += [f"{static_tree}+min:{p:g}{chain}" for p in gates]
  return out + ([f"lookup:{lookup}"] if lookup else [])


def tune_end_to_end(
  target, drafter, prompts, trees, *, temperatures, max_new_tokens, eos_ids, pad_id, batch_size
):
  """Decodes `prompts` with each of `trees` and plainly, at each temperature, interleaved.

  Returns `infer.measure` rows (plain decoding's have method `none`) and the fastest tree per
  temperature.
  """
  width = prompts_lib.bucket(max(map(len, prompts)))
  settings, runners = [], {}
  for t in temperatures:
    for tree in ["", *trees]:
      k = drafter.cfg.num_draft if tree else 0
      s = measure.Setting(
        drafter.cfg.kind if tree else "none", "calibration", t, batch_size, k, tree
      )
      cfg = s.decode_config(max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
      runners[s] = measure.OurMethod(target, drafter if tree else None, cfg, pad_id, width)
      settings.append(s)
  rows = measure.measure(settings, runners, {"calibration": prompts}, seed=0)
  best = {}
  for t in temperatures:
    mine = [r for r in rows if r["temperature"] == t and r["tree"]]
    best[t] = max(mine, key=lambda r: r["tokens_per_s"])["tree"]
  return rows, best


def write_trees(directory: str, best: dict[float, str], platform: str) -> None:
  """Stores the chosen trees in a drafter file for the platform they were timed on
  (`device_trees`): `tree` for T = 0, `sampling_tree` for T > 0. Other platforms keep theirs."""
  path = os.path.join(directory, drafter_files.CONFIG_FILE)
  with open(path) as fh:
    config = json.load(fh)
  trees = config.setdefault(drafter_files.DEVICE_TREES, {}).setdefault(platform, {})
  for t, tree in best.items():
    trees["tree" if t == 0 else "sampling_tree"] = tree
  with open(path, "w") as fh:
    fh.write(json.dumps(config, indent=2) + "\n")


def main():
  if FLAGS.method not in drafter_lib.KINDS:
    raise ValueError(
      f"--method must be one of {', '.join(drafter_lib.KINDS)}, got {FLAGS.method!r}"
    )
  sizes = [int(n) for n in FLAGS.sizes]
  if FLAGS.pool < 2 or min(sizes, default=0) < 2 or FLAGS.num_prompts < 1 or FLAGS.repeats < 1:
    raise ValueError("--pool and every --sizes entry must be >= 2; --num_prompts, --repeats >= 1")
  temperatures = [float(t) for t in FLAGS.temperatures]
  gates = [float(p) for p in FLAGS.gates]
  if any(t < 0 for t in temperatures) or any(not 0 < p < 1 for p in gates) or FLAGS.lookup < 0:
    raise ValueError("--temperatures must be >= 0, --gates in (0, 1) and --lookup >= 0")
  if FLAGS.write and (not FLAGS.end_to_end or sum(t > 0 for t in temperatures) > 1):
    raise ValueError("--write needs --end_to_end and at most one temperature above 0")
  # The drafter's flags, checked before the target's weights are read.
  name = checkpoints.load_target_config(FLAGS.target).name
  directory = drafter_files.drafter_source(FLAGS.method, FLAGS.drafter, name)
  if FLAGS.write and directory in (None, "random"):
    raise ValueError("--write needs a drafter directory (a trained drafter, not pld or random)")
  tokenizer = checkpoints.load_tokenizer(FLAGS.target)
  prompts = measure.encode_prompts(
    tokenizer,
    prompts_lib.prompts_from(FLAGS.prompts),
    source=FLAGS.prompts,
    count=FLAGS.num_prompts,
    max_tokens=FLAGS.max_prompt_tokens,
  )
  target = checkpoints.load_target(FLAGS.target, weight_layout="decode")
  drafter = drafter_files.resolve_drafter(
    FLAGS.method, directory, target, num_draft=FLAGS.num_draft
  )
  eos_ids = checkpoints.eos_token_ids(FLAGS.target, tokenizer)
  rows, rounds = tune(
    target,
    drafter.with_head(target),
    prompts,
    pool_nodes=FLAGS.pool,
    sizes=sizes,
    max_new_tokens=FLAGS.max_new_tokens,
    eos_ids=eos_ids,
    repeats=FLAGS.repeats,
    batch_size=FLAGS.batch_size,
  )
  chosen = max(rows, key=lambda r: r["speedup"])
  print(
    f"# Tree tuning: {FLAGS.method} (K={drafter.cfg.num_draft}) on {FLAGS.target}, "
    f"{len(prompts)} {FLAGS.prompts} prompts, {rounds} calibration rounds, pool of {FLAGS.pool}\n"
  )
  print("| nodes | tokens/round | ms/round | expected speedup | tree |")
  print("|---|---|---|---|---|")
  for r in rows:
    mark = " (best)" if r is chosen else ""
    print(
      f"| {r['nodes']} | {r['tokens_per_round']:.3f} | {r['ms']:.2f} | "
      f"{r['speedup']:.3f}{mark} | {r['tree'] or 'none (plain decoding)'} |"
    )
  if chosen["tree"]:
    print(f"\nUse: --tree={chosen['tree']}")
  else:
    print("\nNo tree beats plain decoding on this device with this drafter.")
  timed, best = [], {}
  if FLAGS.end_to_end:
    # The fastest static tree with a drafted node (the 2-node one if plain decoding won).
    static = chosen["tree"] or rows[1]["tree"]
    timed, best = tune_end_to_end(
      target,
      drafter.with_head(target),
      prompts,
      tree_candidates(static, gates, FLAGS.lookup),
      temperatures=temperatures,
      max_new_tokens=FLAGS.max_new_tokens,
      eos_ids=eos_ids,
      pad_id=tokenizer.pad_token_id or 0,
      batch_size=FLAGS.timed_batch_size,
    )
    print(f"\n# End to end: {len(prompts)} prompts, batch size {FLAGS.timed_batch_size}\n")
    print("| T | tree | tokens/s | speedup | tau | lossless |")
    print("|---|---|---|---|---|---|")
    for r in timed:
      mark = " (best)" if r["tree"] and best[r["temperature"]] == r["tree"] else ""
      lossless = "" if r["lossless"] is None else "yes" if r["lossless"] else "NO"
      print(
        f"| {r['temperature']:g} | {r['tree'] or 'none (plain decoding)'} | "
        f"{r['tokens_per_s']:.1f} | {r['speedup']:.3f}{mark} | {r['tau']:.2f} | {lossless} |"
      )
    for t, tree in best.items():
      print(f"\nAt T = {t:g} use: --tree={tree}")
    if FLAGS.write:
      write_trees(directory, best, jax.default_backend())
      print(f"\nWrote them to {os.path.join(directory, 'drafter.json')}")
  if FLAGS.out:
    meta = dict(
      method=FLAGS.method,
      target=FLAGS.target,
      num_draft=drafter.cfg.num_draft,
      prompts=FLAGS.prompts,
      num_prompts=len(prompts),
      calibration_rounds=rounds,
      pool=FLAGS.pool,
    )
    with open(FLAGS.out, "w") as f:
      best_by_t = {f"{t:g}": tree for t, tree in best.items()}
      record = dict(
        meta=meta, rows=rows, best=chosen["tree"], end_to_end=timed, best_by_t=best_by_t
      )
      json.dump(record, f, indent=1)


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  flags.DEFINE_string("target", "smollm2-135m-instruct", "Target name, HF directory or .gguf file.")
  flags.DEFINE_string("method", "pspec", "Drafter kind: pspec, eagle, medusa or pld.")
  flags.DEFINE_string("drafter", None, "Drafter directory or `random`; default: the shipped one.")
  flags.DEFINE_integer("num_draft", 4, "K of a random or pld drafter (a saved one keeps its own).")
  flags.DEFINE_string(
    "prompts", "sharegpt", "Calibration prompts: mt_bench, humaneval, sharegpt or a JSONL file."
  )
  flags.DEFINE_integer("num_prompts", 8, "Calibration prompts used.")
  flags.DEFINE_integer("max_prompt_tokens", 512, "Longer prompts are passed over.")
  flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per calibration prompt.")
  flags.DEFINE_integer("batch_size", 4, "Calibration prompts decoded together.")
  flags.DEFINE_integer("pool", 64, "Nodes of the calibration tree (root included).")
  flags.DEFINE_list(
    "sizes", ["2", "3", "4", "5", "6", "8", "10", "12", "16", "24", "32"], "Tree sizes N tried."
  )
  flags.DEFINE_integer("repeats", 20, "Timed rounds per tree size.")
  flags.DEFINE_bool("end_to_end", True, "Stage 3: time gated and lookup trees end to end.")
  flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures of stage 3, a choice for each.")
  flags.DEFINE_list("gates", ["0.1", "0.2", "0.3", "0.4"], "Gate thresholds P tried in stage 3.")
  flags.DEFINE_integer("lookup", 6, "Prompt-lookup chain L tried in stage 3 (0: none).")
  flags.DEFINE_integer("timed_batch_size", 1, "Batch size of stage 3's timed decoding.")
  flags.DEFINE_bool("write", False, "Store stage 3's choices in the drafter's drafter.json.")
  flags.DEFINE_string("out", "", "Also write the tables and the choices to this JSON file.")


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
