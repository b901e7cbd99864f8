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

  cost(c) = round(c) / plain round

where round(c) is a round of the decoding loop with the choice pinned to c (the lookup search,
the verification of c's nodes, acceptance, the commit, the choice and c's next draft; rounds
that draft nothing include their share of the feed that takes in the pairs they leave pending)
and the plain round one of plain decoding, both timed as the loop runs them, several in a row
updating the state in place. Each candidate has two costs: without and with its prompt-lookup
chain verified. Summed from a round's passes instead, realized rounds had cost 9% (fixed trees)
to 25% (adaptive ones) more than calibrated.

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
from pspec_jax import rounds as rounds_lib

VERSION = 3  # 3: whole rounds timed with the choice pinned (2: summed from their passes)
FILE = "round_costs.json"
# The pinned candidate's cost, and every other option's: only the pinned one is affordable.
PINNED_IN, PINNED_OUT = 1e-3, 1e9


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


def _pinned(state, choice: int, chain: bool, num: int):
  """`state` with the candidate of its next round pinned: made the only affordable option
  (`adaptive.choose` then picks it every round), and chosen for the round about to run. Its
  chain pinned on, it runs without one in rounds where no lookup is found."""
  pin = jnp.full((2, num), PINNED_OUT, jnp.float32).at[:, choice].set(10 * PINNED_IN)
  pin = pin.at[int(chain), choice].set(PINNED_IN)
  stats = state.adapt.replace(costs=pin, choice=jnp.int32(choice), chain=jnp.bool_(chain))
  return state.replace(adapt=stats)


@functools.partial(jax.jit, static_argnums=0)
def _rounds(plan, target, drafter, state, count):
  """`count` rounds of the decoding loop, in place as inside `decode.generate`'s loop (one
  compilation for any count)."""
  step = lambda _, s: rounds_lib.round_step(plan, target, drafter, s)
  return jax.lax.fori_loop(0, count, step, state)


def measure(target, drafter, pool, batch: int, ids: list[int], cfg=None, repeats: int = 5) -> dict:
  """Raw times (ms per round, medians of `repeats`) and the costs of every candidate of `pool`,
  under the sampling settings and draft rule of DecodeConfig `cfg` (default: greedy).

  Rounds are timed whole, as the decoding loop runs them, `kept + 1` in a row (one pending
  buffer's worth of rounds that draft nothing): the lookup search, the verification of the
  candidate's nodes, acceptance, the commit, the choice and the next draft, with the choice
  pinned to the candidate; and plain rounds the same way. The context is the prompt `ids`
  twice, so the lookup finds a match and the chain runs where it is pinned on.

  Returns {candidate spec: {"costs": [without, with lookup], ...times}}.
  """
  inputs = (*prompts_lib.pad_batch([ids + ids] * batch), jax.random.key(0))  # tokens, lengths, key
  drafter = drafter.with_head(target)
  cfg = cfg or decode.DecodeConfig()
  kept = pool.max_depth + 1
  count = kept + 1
  base = dataclasses.replace(cfg, max_new_tokens=(count + 2) * kept, costs=(), mesh=None)
  width = inputs[0].shape[1]
  plain = decode.make_plan(base, None, width)
  state = decode.init(plain, target, None, *inputs)
  calls = {"plain": (_rounds, plain, target, None, state, count)}
  plan = decode.make_plan(dataclasses.replace(base, tree=pool.spec), drafter, width)
  state = decode.init(plan, target, drafter, *inputs)
  num = len(pool.candidates)
  for c, cand in enumerate(pool.candidates):
    for chain in (False, True) if cand.lookup else (False,):
      # One round first, so the timed ones start from nodes drafted for this candidate.
      ready = _rounds(plan, target, drafter, _pinned(state, c, chain, num), 1)
      calls[(c, chain)] = (_rounds, plan, target, drafter, ready, count)
  ms = {name: t / count for name, t in measure_lib.interleaved_ms(calls, repeats).items()}
  out = {}
  for c, cand in enumerate(pool.candidates):
    round_ms = [ms.get((c, chain), ms[(c, False)]) for chain in (False, True)]
    n0, n1 = adaptive.verified_nodes(pool)[c]
    out[cand.spec] = dict(
      costs=[1.0 if c == 0 else max(1.0, t / ms["plain"]) for t in round_ms],
      plain_ms=ms["plain"],
      round_ms=round_ms,
      nodes=[n0, n1],
    )
  return out


def explain(key: str, entries: dict[str, dict]) -> str:
  """A table of the candidates' costs and the times they come from."""
  lines = [
    f"Round costs on {key} (a plain round is 1; from raw medians, ms):",
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
