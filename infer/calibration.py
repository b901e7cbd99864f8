"""What a round with each candidate of an adaptive tree costs on this machine, measured once.

An adaptive tree (`pspec_jax.adaptive`) weighs each candidate's expected tokens against the cost
of a round with it, relative to a plain round. The costs depend on the device, the target, its
dtype and the batch size, so they are measured once per (device kind, target, dtype, batch) and
kept in `pspec_jax.cache_dir("calibration")/round_costs.json`, one entry per candidate (its
drafter kind, draft vocabulary and tree) and acceptance rule: a sampled round (T > 0) costs
more than a greedy one, and more again with drafts drawn from q (filtering, Gumbel draws), so
sampled rounds are timed at their own sampling settings and kept apart (`rule_key`). A
program that decodes with an adaptive tree (`infer.generate`, `infer.bench`) reads them from
there, measuring what is missing at its first decode (a few jitted passes, compiled and
timed); `python -m infer.calibrate` measures on demand. Every measurement is printed and
stored with its raw times:

  cost(c) = 1 + (verify(nodes of c) - verify(1) + draft(c) - feed) / (plain round + feed)

where verify(n) is one target pass over n tree nodes, draft(c) the drafter's pass for c's
nodes, feed what the drafter costs a round that drafts nothing (taking in the pairs that
rounds left pending, once per kept + 1 such rounds: what a round with the root alone adds to
a plain one) and the plain round a whole auto-regressive round. Each candidate has
two costs: without and with its prompt-lookup chain verified.

A file that cannot be read as a calibration (corrupt, or of another version) is reported in one
line and measured again; it never stops a decode.
"""

import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pspec_jax
from infer import measure as measure_lib
from pspec_jax import adaptive, cpu_kernel, decode
from pspec_jax import drafter as drafter_lib
from pspec_jax import prompts as prompts_lib
from pspec_jax import propose as propose_lib
from pspec_jax import tree as tree_lib

VERSION = 2  # 2: rounds that draft nothing leave their pairs pending (cheaper root rounds)
FILE = "round_costs.json"


def default_path() -> str:
  return os.path.join(pspec_jax.cache_dir("calibration"), FILE)


def machine_key(target, batch: int) -> str:
  """The calibration's key: device kind, target, dtype, batch size, and for panel weights
  what runs them (the CPU kernels or XLA's path cost very differently)."""
  device = jax.devices()[0]
  dtype = np.dtype(target.cfg.dtype).name
  key = f"{device.platform}:{device.device_kind}|{target.cfg.name}|{dtype}|batch={batch}"
  if target.cfg.weight_layout == "panels":
    key += f"|panels: {cpu_kernel.describe()}"
  return key


def rule_key(cfg, drafter) -> str:
  """The acceptance rule a round is timed under: "" when greedy, else the sampling filters and
  whether drafts are drawn from q (the temperature itself costs nothing)."""
  s = cfg.sampling
  if s.greedy:
    return ""
  drawn = decode.make_plan(dataclasses.replace(cfg, costs=()), drafter, 1).drawn
  return f" [T>0 top_k={s.top_k} top_p={s.top_p:g}, drafts {'from q' if drawn else 'top-k'}]"


def candidate_key(drafter, candidate, rule: str = "") -> str:
  """One candidate's entry: the drafter kind (and draft vocabulary), the tree and the
  acceptance rule (`rule_key`)."""
  c = drafter.cfg
  vocab = f"/v{c.draft_vocab_size}" if c.draft_vocab_size else ""
  return f"{c.kind}{vocab} {candidate.spec}{rule}"


def load(path: str) -> dict:
  """The calibrations stored at `path` ({} if there is no file). ValueError if it is corrupt,
  or of another version."""
  if not os.path.exists(path):
    return {}
  corrupt = f"calibration file {path} is corrupt"
  try:
    with open(path) as fh:
      data = json.load(fh)
  except (OSError, ValueError) as e:
    raise ValueError(f"{corrupt} ({e})") from None
  version = data.get("version") if isinstance(data, dict) else None
  if isinstance(version, int) and version != VERSION:
    # Costs of rounds this code no longer runs: not corrupt, but measured again all the same.
    raise ValueError(f"calibration file {path} is of version {version}, not {VERSION}")
  try:
    if version != VERSION or not isinstance(data.get("machines"), dict):
      raise ValueError(f"not a version-{VERSION} calibration")
    for machine in data["machines"].values():
      for entry in machine.values():
        costs = entry["costs"]
        if len(costs) != 2 or not all(isinstance(x, float | int) and x > 0 for x in costs):
          raise ValueError(f"bad costs {costs!r}")
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{corrupt} ({e})") from None
  return data["machines"]


def save(path: str, machines: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as fh:
    json.dump(dict(version=VERSION, machines=machines), fh, indent=2)
  os.replace(tmp, path)  # whole or not at all


def measure(target, drafter, pool, batch: int, ids: list[int], cfg=None, repeats: int = 15) -> dict:
  """Raw times (ms, medians of `repeats`) and the costs of every candidate of `pool`, under
  the sampling settings and draft rule of DecodeConfig `cfg` (default: greedy).

  Returns {candidate spec: {"costs": [without, with lookup], ...times}}.
  """
  inputs = (*prompts_lib.pad_batch([ids] * batch), jax.random.key(0))  # tokens, lengths, key
  drafter = drafter.with_head(target)
  cfg = cfg or decode.DecodeConfig()
  base = dataclasses.replace(cfg, max_new_tokens=pool.max_depth + 8, costs=(), mesh=None)
  # Every pass is compiled first, then all are timed in turns (`measure.interleaved_ms`), so
  # the machine's drift hits them alike.
  width = inputs[0].shape[1]
  plain = decode.make_plan(base, None, width)
  calls = {
    "plain": (decode.round_step, plain, target, None, decode.init(plain, target, None, *inputs))
  }
  # A verification pass over n nodes: a chain of n - 1 prompt-lookup drafts (no drafter pass).
  pld = drafter_lib.Drafter(
    cfg=drafter_lib.DrafterConfig.for_target("pld", target.cfg, num_draft=1), params={}
  )
  nodes = sorted({n for pair in adaptive.verified_nodes(pool) for n in pair})
  for n in nodes:
    d = pld if n > 1 else None
    plan = decode.make_plan(
      dataclasses.replace(base, tree="chain", num_draft=max(n - 1, 1)), d, width
    )
    calls[f"verify {n}"] = (decode.verify, plan, target, d, decode.init(plan, target, d, *inputs))
  # The drafter's pass per candidate, on pairs as wide as a round of the union tree gives, or
  # as its pending buffer (`rounds.PENDING_ROUNDS`) when rounds that draft nothing leave their
  # pairs pending: then a feed comes once per kept + 1 of them (one pair each).
  kept = pool.max_depth + 1
  plan = decode.make_plan(base, drafter, width)
  state = decode.init(plan, target, drafter, *inputs)
  rows, rounds_per_feed = kept, 1
  if state.pending is not None:
    rows, rounds_per_feed = state.pending.tokens.shape[1], kept + 1
  pairs = propose_lib.Pairs(
    tokens=jnp.ones((batch, rows), jnp.int32),
    features=jnp.ones((batch, rows, drafter.cfg.feature_width), target.cfg.dtype),
    count=jnp.ones((batch,), jnp.int32),
  )
  calls["feed"] = (jax.jit(propose_lib.feed), drafter, target, state.drafter_cache, pairs)

  # A sampled round draws its drafts from q: the filtering and the draws are part of the pass.
  @functools.partial(jax.jit, static_argnames="pool")
  def propose(drafter, target, cache, pairs, context, pool, key):
    draw = propose_lib.Draw(plan.sampling, key) if plan.drawn else None
    return propose_lib.propose(drafter, target, cache, pairs, context, pool, draw)

  context = (state.tokens, state.num_tokens)
  for cand in pool.candidates:
    if cand.paths:
      drafted = tree_lib.Tree(paths=cand.paths)
      args = (drafter, target, state.drafter_cache, pairs, context, drafted, inputs[2])
      calls[f"draft {cand.spec}"] = (propose, *args)
  ms = measure_lib.interleaved_ms(calls, repeats)
  plain_ms, feed_ms = ms["plain"], ms["feed"] / rounds_per_feed  # per round drafting nothing
  verify_ms = {n: ms[f"verify {n}"] for n in nodes}
  draft_ms = [ms.get(f"draft {c.spec}", feed_ms) for c in pool.candidates]
  costs = adaptive.relative_costs(
    pool, plain_ms + feed_ms, verify_ms, [ms - feed_ms for ms in draft_ms]
  )
  out = {}
  for c, cand in enumerate(pool.candidates):
    n0, n1 = adaptive.verified_nodes(pool)[c]
    out[cand.spec] = dict(
      costs=list(costs[c]),
      plain_ms=plain_ms,
      feed_ms=feed_ms,
      draft_ms=draft_ms[c],
      verify_ms=[verify_ms[n0], verify_ms[n1]],
      verify_root_ms=verify_ms[1],
      nodes=[n0, n1],
    )
  return out


def explain(key: str, entries: dict[str, dict]) -> str:
  """A table of the candidates' costs and the times they come from."""
  lines = [
    f"Round costs on {key} (a plain round is 1; from raw medians, ms):",
    "| candidate | nodes | cost | cost with lookup | draft ms | verify ms | plain round ms |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, e in entries.items():
    lines.append(
      f"| {name} | {e['nodes'][0]}/{e['nodes'][1]} | {e['costs'][0]:.3f} | {e['costs'][1]:.3f} | "
      f"{e['draft_ms']:.2f} | {e['verify_ms'][0]:.2f}/{e['verify_ms'][1]:.2f} | "
      f"{e['plain_ms']:.2f} |"
    )
  return "\n".join(lines)


def costs_for(
  target,
  drafter,
  cfg,
  batch: int,
  ids: list[int],
  *,
  path: str | None = None,
  log=None,
  recalibrate: bool = False,
) -> tuple[tuple[float, float], ...]:
  """The candidate costs of `cfg`'s adaptive tree for `DecodeConfig.costs` (() for any other
  tree): read from the calibration file, the missing ones measured (on prompt `ids`, `batch`
  copies of it) and stored. `log` (default: stderr) gets every measured table and any problem
  with the file; `recalibrate` measures every candidate again."""
  log = log or (lambda text: print(text, file=sys.stderr, flush=True))
  pool = decode.resolve_tree(cfg, drafter)
  if not pool.candidates:
    return ()
  path = path or default_path()
  try:
    machines = load(path)
  except ValueError as e:
    log(f"{e}: measuring again")
    machines = {}
  key = machine_key(target, batch)
  entries = machines.setdefault(key, {})
  rule = rule_key(cfg, drafter)
  names = [candidate_key(drafter, c, rule) for c in pool.candidates]
  if recalibrate or any(n not in entries for n in names):
    log(f"calibrating round costs for {pool.spec}{rule} on {key} ...")
    measured = measure(target, drafter, pool, batch, ids, cfg)
    fresh = {n: measured[c.spec] for n, c in zip(names, pool.candidates, strict=True)}
    entries.update(fresh)
    log(explain(key, fresh))
    save(path, machines)
    log(f"stored in {path}")
  return tuple(tuple(entries[n]["costs"]) for n in names)
