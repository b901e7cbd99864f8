"""What a round with each candidate of an adaptive tree costs on this machine, measured once.

An adaptive tree (`pspec_jax.adaptive`) weighs each candidate's expected tokens against the cost
of a round with it, relative to a round with the root alone. The costs depend on the device, the
target, its dtype and the batch size, so they are measured once per (device kind, target, dtype,
batch) and kept in `pspec_jax.cache_dir("calibration")/round_costs.json`, one entry per candidate
(its drafter kind, draft vocabulary and tree) and acceptance rule: a sampled round (T > 0) costs
more than a greedy one, and more again with drafts drawn from q (filtering, Gumbel draws), so
sampled rounds are timed at their own sampling settings and kept apart (`rule_key`). A program
that decodes with an adaptive tree (`infer.generate`, `infer.bench`) reads them from there,
measuring what is missing at its first decode; `python -m infer.calibrate` measures on demand.
Every measurement is printed and stored with its raw times:

  cost(c) = round(c) / round(root alone)

where round(c) is a round of c as the decoding program runs it while c stays chosen: c's draft,
the verification of its nodes, acceptance, the commit, the statistics, the lookup search and the
next choice (a round that drafts nothing adds its share of the feed that takes in the pairs such
rounds leave pending). The rounds are timed in the program that decodes: `decode.run`, compiled
for the decode's own shapes, with its `restart` on, which starts every round from one state (the
caches updated in place, as when decoding) where the choice is pinned to c. So calibrating
compiles nothing the decode does not (the first decode then starts at once), and takes seconds:
the rounds themselves, `SHORT_ROUNDS` and `ROUNDS` per option per turn (a round is the
difference over `ROUNDS - SHORT_ROUNDS`, so the call's own cost cancels). The state's context
repeats the prompt, so the lookup finds a match and a candidate's chain runs. Each candidate
has two costs: without and with its prompt-lookup chain verified. Summed from a round's passes
instead, realized rounds had cost 9% (fixed trees) to 25% (adaptive ones) more than calibrated.

The candidates are timed in turns, `REPEATS` of them, and a cost is the median over turns of the
candidate's time against the root alone's in the same turn. On a shared 2-core machine ten
root-alone rounds took 306 to 482 ms within one calibration, and costs taken as a ratio of medians
over 5 turns came out 1.27 in one sitting and 1.37 in another for the same candidate. That was
enough to turn the loop's choice at T = 1, where the candidates' tokens per cost lie within a few
percent of each other. Paired over 15 turns, the same costs in three calibrations of one sitting
spread by 1-5% (1.31-1.33 and 1.33-1.40 for the two drafted candidates asked about), and matched
the candidates' rounds timed inside whole decodes with the choice pinned (1.27 and 1.36).
An option's round that comes out at or below zero in a turn (its short call slowed more than its
long one, as when a test suite shares the cores) is left out, and more turns are timed; where
most turns stay noise, each option's round comes from its fastest calls (a warning says so).

A file that cannot be read as a calibration (corrupt, or of another version) is reported in one
line and measured again; it never stops a decode.
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pspec_jax
from infer import measure as measure_lib
from pspec_jax import adaptive, cpu_kernel, decode
from pspec_jax import propose as propose_lib
from pspec_jax import rounds as rounds_lib

# 14: rounds timed from an active context (an earlier one could start done, and store noise);
# 13: the pending pairs' feed a while loop (root-alone rounds no longer copy the drafter's
# cache); 12: a round the difference of two run lengths (the call's own cost cancels);
# 11: medusa's heads one dense weight (its drafting rounds cheaper on a CPU);
# 10: timed in the decoding program itself (`decode.run` restarted), at the decode's shapes;
# 8: an option's rounds as the adaptive loop runs them (`rounds.adaptive_rounds`), no switch;
# 7: a candidate's round without its lookup chain verifies its drafted tree alone (2-6% of a
# plain round cheaper); 6: costs from paired turns (`measure.paired_ratio`), 15 of them;
# 5: an adaptive round's bonus noise drawn before its switch (root-alone rounds 4% cheaper at
# T = 1); 4: whole rounds from one context, against the root alone; 2: summed passes.
VERSION = 14
FILE = "round_costs.json"
# The pinned candidate's cost, and every other option's: only the pinned one is affordable.
PINNED_IN, PINNED_OUT = 1e-3, 1e9
# Each option is timed over SHORT_ROUNDS and ROUNDS rounds in a row, and its round is the
# difference over ROUNDS - SHORT_ROUNDS: what a call costs besides its rounds (dispatch, the
# context's copy; 1.5 ms a round over 10 on a 2-core Xeon, half a plain step) cancels, where it
# would add the same to every option and pull their costs towards the root alone's.
SHORT_ROUNDS, ROUNDS = 2, 12
REPEATS = 15  # turns timed (`measure.interleaved_times`)
# An option's round that comes out at or below zero in a turn (its short call slowed more than
# its long one: another process took the cores) says nothing and is left out; up to ATTEMPTS
# times `repeats` turns are timed until each option has half of `repeats` turns to compare
# (after that, the fastest calls of all turns give each option's round: `_round_times`).
ATTEMPTS = 2


def _to_stderr(text: str) -> None:
  """The default `log`: stderr."""
  print(text, file=sys.stderr, flush=True)


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


def _start(plan, target, drafter, ids: list[int], batch: int, width: int):
  """The state rounds are timed from: `batch` copies of prompt `ids` (cut to half of `width`)
  twice, prefilled at the decode's width, the adaptive costs any (the option is pinned later),
  and the first bonus token made the prompt's first one, so the context ends as the first copy
  flows into the second and the lookup finds a match (a chain of the prompt). Every sequence is
  active, whatever token the prefill chose: had it chosen an EOS (or were the budget one token),
  every sequence would start done, no round would run, and the costs would be noise (a prompt
  cut at half the width did that at batch 2: a root-alone "round" of 0.15 ms, every cost 1)."""
  ids = ids[: width // 2]
  tokens = np.zeros((batch, width), np.int32)
  tokens[:, : 2 * len(ids)] = ids + ids
  lengths = np.full((batch,), 2 * len(ids), np.int32)
  costs = jnp.ones((len(plan.tree.candidates), 2), jnp.float32)
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0), costs)
  return state.replace(
    tokens=state.tokens.at[:, 2 * len(ids)].set(ids[0]), done=jnp.zeros_like(state.done)
  )


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class _Rounds:
  """Rounds of the decoding program (`decode.run`, restarted: each round from one state's
  context) for each pinned state: one call times one option. The calls share the
  caches' buffers, which `decode.run` takes (donated) and hands back updated in place."""

  def __init__(self, plan, target, drafter, state):
    self.plan, self.target, self.drafter = plan, target, drafter
    self.carried = state  # whose caches' buffers the next call takes

  def timer(self, start, rounds: int):
    """A call of `rounds` rounds from `start` (a state whose buffers are not read)."""
    context = rounds_lib.without_buffers(start)

    def call():
      state = rounds_lib.with_buffers(_copy(context), self.carried)  # `decode.run` takes it
      out = decode.run(
        self.plan, self.target, self.drafter, state, state.step + rounds, np.bool_(True)
      )
      self.carried = out
      return out

    return call


def _round_times(calls: dict, options, repeats: int, kept: int, log):
  """ms per round of each option (NaN in a turn where it came out at or below zero), and the
  feed's share of a round, per turn, from `calls` (`measure`'s): turns are timed until each
  option has at least half of `repeats` turns positive along with the root alone's. Where it
  has not after ATTEMPTS times `repeats` turns, each option's round is taken in every turn from
  its fastest calls (the ones least delayed), and `log` says so."""
  times = {name: [] for name in calls}
  for _ in range(ATTEMPTS):
    for name, t in measure_lib.interleaved_times(calls, repeats).items():
      times[name] += t
    t = {name: np.asarray(t) for name, t in times.items()}
    feed = t.pop("feed", np.zeros(len(t[(0, False, ROUNDS)]))) / (kept + 1)
    per_round = {}
    for c, chain in options:
      long, short = t[(c, chain, ROUNDS)], t[(c, chain, SHORT_ROUNDS)]
      per_round[(c, chain)] = np.where(
        long > short, (long - short) / (ROUNDS - SHORT_ROUNDS), np.nan
      )
    root = ~np.isnan(per_round[(0, False)])
    fewest = min(np.sum(root & ~np.isnan(r)) for r in per_round.values())
    if 2 * fewest >= repeats:
      return per_round, feed
  log(
    f"round times were noise: an option's rounds came out above zero in {fewest} of {len(feed)} "
    "turns along with the root alone's (is another program using the cores?); each option's "
    "round is taken from its fastest calls"
  )
  for c, chain in options:
    long, short = t[(c, chain, ROUNDS)].min(), t[(c, chain, SHORT_ROUNDS)].min()
    fastest = (long - short) / (ROUNDS - SHORT_ROUNDS) if long > short else long / ROUNDS
    per_round[(c, chain)] = np.full(len(feed), fastest)
  return per_round, feed


def measure(
  target, drafter, cfg, batch: int, ids: list[int], width: int, repeats: int = REPEATS, log=None
) -> dict:
  """Raw times (ms per round, medians of `repeats`) and the costs of every candidate of the
  adaptive tree of DecodeConfig `cfg`, for prompts `width` tokens wide, under its sampling
  settings and draft rule.

  Rounds are timed whole, in the program that decodes (`decode.run` for `cfg`'s plan at this
  width, restarted: compiled once for both), `SHORT_ROUNDS` and `ROUNDS` in a row from the same
  context (a round: the difference over `ROUNDS - SHORT_ROUNDS`), with the
  choice pinned to each option (a candidate with and without its chain) in turn. The context is
  the prompt `ids` twice and its first token again, so the lookup finds a match and a chain runs
  where the option has it. A round that drafts nothing leaves its pairs pending, and a feed
  takes them in once per `kept + 1` such rounds: that share of a feed is added to its time.
  Costs are relative to the root alone's round.

  Returns {candidate spec: {"costs": [without, with lookup], ...times}}.
  """
  drafter = drafter.with_head(target)
  plan = decode.make_plan(cfg, drafter, width)
  pool = plan.tree
  state = _start(plan, target, drafter, ids, batch, width)
  rounds = _Rounds(plan, target, drafter, state)
  calls = {}
  for c, chain in adaptive.options(pool):
    pinned = _pinned(state, c, chain, pool)
    for n in (SHORT_ROUNDS, ROUNDS):
      calls[(c, chain, n)] = (rounds.timer(pinned, n),)
  kept = pool.max_depth + 1
  if state.drafter_cache is not None:  # a buffer's worth of pending pairs, taken in by one feed
    pending = state.pending
    full = pending.replace(count=jnp.full_like(pending.count, pending.tokens.shape[1]))
    cache = _copy(state.drafter_cache)  # the rounds take the state's own buffers
    calls["feed"] = (jax.jit(propose_lib.feed), drafter, target, cache, full)
  log = log or _to_stderr
  per_round, feed = _round_times(calls, adaptive.options(pool), repeats, kept, log)
  root = per_round[(0, False)] + feed  # the root alone: the adaptive round to beat
  out = {}
  for c, cand in enumerate(pool.candidates):
    share = 0.0 if cand.paths else feed
    # A chain alone without its chain is the root alone; a candidate without one, itself.
    alone = per_round.get((c, False), per_round[(0, False)])
    per_turn = [per_round.get((c, chain), alone) + share for chain in (False, True)]
    n0, n1 = adaptive.verified_nodes(pool)[c]
    ratios = [measure_lib.paired_ratio(t, root) for t in per_turn]
    out[cand.spec] = dict(
      costs=[1.0 if c == 0 else max(1.0, float(r)) for r in ratios],
      round_ms=[float(np.nanmedian(t)) for t in per_turn],
      nodes=[n0, n1],
    )
  return out


def explain(key: str, entries: dict[str, dict]) -> str:
  """A table of the candidates' costs and the times they come from."""
  lines = [
    f"Round costs on {key} (a round with the root alone is 1; round times are medians, ms):",
    "| candidate | nodes | cost | cost with lookup | round ms |",
    "|---|---|---|---|---|",
  ]
  for name, e in entries.items():
    lines.append(
      f"| {name} | {e['nodes'][0]}/{e['nodes'][1]} | {e['costs'][0]:.3f} | {e['costs'][1]:.3f} | "
      f"{e['round_ms'][0]:.2f}/{e['round_ms'][1]:.2f} |"
    )
  return "\n".join(lines)


def costs_for(
  target,
  drafter,
  cfg,
  batch: int,
  ids: list[int],
  width: int,
  *,
  path: str | None = None,
  log=None,
  recalibrate: bool = False,
) -> tuple[tuple[float, float], ...]:
  """The candidate costs of `cfg`'s adaptive tree for `DecodeConfig.costs` (() for any other
  tree): read from the calibration file, the missing ones measured (on prompt `ids`, `batch`
  copies of it, in the program that decodes prompts `width` tokens wide) and stored. `log`
  (default: stderr) gets every measured table and any problem with the file; `recalibrate`
  measures every candidate again."""
  log = log or _to_stderr
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
    measured = measure(target, drafter, cfg, batch, ids, width, log=log)
    fresh = {n: measured[c.spec] for n, c in zip(names, pool.candidates, strict=True)}
    entries.update(fresh)
    log(explain(key, fresh))
    save(path, machines)
    log(f"stored in {path}")
  return tuple(tuple(entries[n]["costs"]) for n in names)
