"""What a round with each candidate of an adaptive tree costs on this machine, measured once.

An adaptive tree (`pspec_jax.adaptive`) weighs each candidate's expected tokens against the cost
of a round with it, relative to a plain round. The costs depend on the device, the target, its
dtype and the batch size, so they are measured once per (device kind, target, dtype, batch) and
kept in `pspec_jax.cache_dir("calibration")/round_costs.json`, one entry per candidate (its
drafter kind, draft vocabulary and tree) and acceptance rule: a sampled round (T > 0) costs
more than a greedy one, and more again with drafts drawn from q (filtering, Gumbel draws), so
sampled rounds are timed at their own sampling settings and kept apart (`rule_key`). A
program that decodes with an adaptive tree (`infer.generate`, `infer.bench`) reads them from
there, measuring what is missing at its first decode (two round programs, compiled and
timed); `python -m infer.calibrate` measures on demand. Every measurement is printed and
stored with its raw times:

  cost(c) = round(c) / round(root alone)

where round(c) is a round of c as the adaptive loop runs it while c stays chosen (the choice pinned
to c, `rounds.adaptive_rounds`): c's draft, the verification of its nodes, acceptance, the commit,
the statistics, the lookup search and the next choice (a round that drafts nothing adds its share of
the feed that takes in the pairs such rounds leave pending). The root alone is the round every
candidate is weighed against; it costs about a round of plain decoding (also timed and printed).
Rounds are timed as the loop runs them: several in a row, the caches updated in place, each from the
same context (where a chain, if the option has it, finds a match). Each candidate has two costs:
without and with its prompt-lookup chain verified. Summed from a round's passes instead, realized
rounds had cost 9% (fixed trees) to 25% (adaptive ones) more than calibrated.

The candidates and the root alone are timed in turns, `REPEATS` of them, and a cost is the
median over turns of the candidate's time against the root alone's in the same turn. On a
shared 2-core machine ten root-alone rounds took 306 to 482 ms within one calibration, and
costs taken as a ratio of medians over 5 turns came out 1.27 in one sitting and 1.37 in
another for the same candidate. That was enough to turn the loop's choice at T = 1, where the
candidates' tokens per cost lie within a few percent of each other. Paired over 15 turns, the
same costs in three calibrations of one sitting spread by 1-5% (1.31-1.33 and 1.33-1.40 for
the two drafted candidates asked about), and matched the candidates' rounds timed inside whole
decodes with the choice pinned (1.27 and 1.36).

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
from pspec_jax import prompts as prompts_lib
from pspec_jax import propose as propose_lib
from pspec_jax import rounds as rounds_lib

# 8: an option's rounds as the adaptive loop runs them (`rounds.adaptive_rounds`), no switch;
# 7: a candidate's round without its lookup chain verifies its drafted tree alone (2-6% of a
# plain round cheaper); 6: costs from paired turns (`measure.paired_ratio`), 15 of them;
# 5: an adaptive round's bonus noise drawn before its switch (root-alone rounds 4% cheaper at
# T = 1); 4: whole rounds from one context, against the root alone; 2: summed passes.
VERSION = 9
FILE = "round_costs.json"
# The pinned candidate's cost, and every other option's: only the pinned one is affordable.
PINNED_IN, PINNED_OUT = 1e-3, 1e9
ROUNDS = 10  # rounds timed in a row (`_rounds`)
REPEATS = 15  # turns timed (`measure.interleaved_times`)


def default_path() -> str:
  return os.path.join(pspec_jax.cache_dir("calibration"), FILE)


def machine_key(target, batch: int) -> str:
  """The calibration's key: device kind, target, dtype, batch size, and for panel weights
  what runs them (the CPU kernels or XLA's path cost very differently; a rebuilt kernel, e.g.
  after its source changed, is measured again)."""
  device = jax.devices()[0]
  dtype = np.dtype(target.cfg.dtype).name
  key = f"{device.platform}:{device.device_kind}|{target.cfg.name}|{dtype}|batch={batch}"
  if target.cfg.weight_layout == "panels":
    build = cpu_kernel.build_id()
    key += f"|panels: {cpu_kernel.describe()}" + (f" build {build}" if build else "")
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


def _pinned(state, choice: int, chain: bool, pool):
  """`state` with the candidate of its next round pinned: made the only affordable option
  (`adaptive.choose` then picks it every round), and chosen for the round about to run. Its
  chain pinned on, it runs without one in rounds where no lookup is found (a chain alone then
  runs the root alone)."""
  runs = adaptive.options(pool)
  if (choice, chain) not in runs:
    raise ValueError(f"no adaptive round runs candidate {choice} with chain={chain}: {runs}")
  alone = choice if (choice, False) in runs else 0
  pin = jnp.full((2, len(pool.candidates)), PINNED_OUT, jnp.float32)
  pin = pin.at[0, alone].set(10 * PINNED_IN).at[1, choice].set(10 * PINNED_IN)
  pin = pin.at[int(chain), choice].set(PINNED_IN)
  stats = state.adapt.replace(costs=pin, choice=jnp.int32(choice), chain=jnp.bool_(chain))
  return state.replace(adapt=stats)


def _start(plan, target, drafter, ids: list[int], batch: int):
  """The state rounds are timed from: `batch` copies of prompt `ids` twice, prefilled, and
  the first bonus token made the prompt's first one, so the context ends as the first copy
  flows into the second and the lookup finds a match (a chain of the prompt)."""
  inputs = (*prompts_lib.pad_batch([ids + ids] * batch), jax.random.key(0))  # tokens, lengths, key
  state = decode.init(plan, target, drafter, *inputs)
  return state.replace(tokens=state.tokens.at[:, 2 * len(ids)].set(ids[0]))


@functools.partial(jax.jit, static_argnums=0)
def _rounds(plan, target, drafter, state, count):
  """`count` rounds of the decoding loop (an adaptive tree's as `rounds.adaptive_rounds` runs
  them, the pinned option's loop running them all), each from `state`'s context: the caches'
  buffers are carried and updated in place, as inside `decode.generate`'s loop, and everything
  else (the tokens, the lengths, the statistics and the choice, the pending pairs) starts over
  from `state`, so every round is the same round. One compilation for any count."""

  def again(s):
    # The context passes an optimization barrier with the carried step, so no part of a round
    # is loop-invariant: XLA would otherwise hoist whatever depends on the context alone (a
    # medusa draft, the lookup's search) out of the timed loop, and the round would time short.
    def buffers(cache, carried):  # `cache` with the carried buffers (None: without any)
      if cache is None:
        return None
      return cache.replace(
        k=None if carried is None else carried.k, v=None if carried is None else carried.v
      )

    context = state.replace(
      cache=buffers(state.cache, None), drafter_cache=buffers(state.drafter_cache, None)
    )
    out, step = jax.lax.optimization_barrier((context, s.step))
    return out.replace(
      cache=buffers(out.cache, s.cache),
      drafter_cache=buffers(out.drafter_cache, s.drafter_cache),
      step=step,
    )

  if plan.tree.candidates:
    stop = state.step + count
    return rounds_lib.adaptive_rounds(plan, target, drafter, state, stop, before_round=again)
  step = lambda _, s: rounds_lib.round_step(plan, target, drafter, again(s))
  return jax.lax.fori_loop(0, count, step, state)


def measure(
  target, drafter, pool, batch: int, ids: list[int], cfg=None, repeats: int = REPEATS
) -> dict:
  """Raw times (ms per round, medians of `repeats`) and the costs of every candidate of `pool`,
  under the sampling settings and draft rule of DecodeConfig `cfg` (default: greedy).

  Rounds are timed whole, as the decoding loop runs them, `ROUNDS` in a row from the same context
  (`_rounds`), with the choice pinned to each option (a candidate with and without its chain) in
  turn, and so are plain rounds. The context is the prompt `ids` twice and its first token again, so
  the lookup finds a match and a chain runs where the option has it. A round that drafts nothing
  leaves its pairs pending, and a feed takes them in once per `kept + 1` such rounds: that share of
  a feed is added to its time. Costs are relative to the root alone's round.

  Returns {candidate spec: {"costs": [without, with lookup], ...times}}.
  """
  drafter = drafter.with_head(target)
  cfg = cfg or decode.DecodeConfig()
  base = dataclasses.replace(cfg, max_new_tokens=pool.max_depth + 8, costs=(), mesh=None)
  plain = decode.make_plan(base, None, 2 * len(ids))
  state = _start(plain, target, None, ids, batch)
  calls = {"plain": (_rounds, plain, target, None, state, ROUNDS)}
  plan = decode.make_plan(dataclasses.replace(base, tree=pool.spec), drafter, 2 * len(ids))
  state = _start(plan, target, drafter, ids, batch)
  for c, chain in adaptive.options(pool):
    calls[(c, chain)] = (_rounds, plan, target, drafter, _pinned(state, c, chain, pool), ROUNDS)
  kept = pool.max_depth + 1
  if state.drafter_cache is not None:  # a buffer's worth of pending pairs, taken in by one feed
    pending = state.pending
    full = pending.replace(count=jnp.full_like(pending.count, pending.tokens.shape[1]))
    calls["feed"] = (jax.jit(propose_lib.feed), drafter, target, state.drafter_cache, full)
  times = measure_lib.interleaved_times(calls, repeats)
  feed = np.asarray(times.pop("feed", [0.0] * repeats)) / (kept + 1)  # per round, per turn
  rounds = {name: np.asarray(t) / ROUNDS for name, t in times.items()}  # ms per round, per turn
  root = rounds[(0, False)] + feed  # the root alone: the adaptive round to beat
  out = {}
  for c, cand in enumerate(pool.candidates):
    share = 0.0 if cand.paths else feed
    # A chain alone without its chain is the root alone; a candidate without one, itself.
    alone = rounds.get((c, False), rounds[(0, False)])
    per_turn = [rounds.get((c, chain), alone) + share for chain in (False, True)]
    n0, n1 = adaptive.verified_nodes(pool)[c]
    ratios = [measure_lib.paired_ratio(t, root) for t in per_turn]
    out[cand.spec] = dict(
      costs=[1.0 if c == 0 else max(1.0, float(r)) for r in ratios],
      plain_ms=float(np.median(rounds["plain"])),
      round_ms=[float(np.median(t)) for t in per_turn],
      nodes=[n0, n1],
    )
  return out


def explain(key: str, entries: dict[str, dict]) -> str:
  """A table of the candidates' costs and the times they come from."""
  lines = [
    f"Round costs on {key} (a round with the root alone is 1; round times are medians, ms):",
    "| candidate | nodes | cost | cost with lookup | round ms | plain round ms |",
    "|---|---|---|---|---|---|",
  ]
  for name, e in entries.items():
    lines.append(
      f"| {name} | {e['nodes'][0]}/{e['nodes'][1]} | {e['costs'][0]:.3f} | {e['costs'][1]:.3f} | "
      f"{e['round_ms'][0]:.2f}/{e['round_ms'][1]:.2f} | {e['plain_ms']:.2f} |"
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
