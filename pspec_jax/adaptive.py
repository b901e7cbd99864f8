"""Adaptive rounds: each round verifies the candidate tree that promises the most tokens per unit
of this machine's cost (docs/design.md section 3.7).

DISCO (Mamou et al.) decides per round whether to draft further; DiffuSpec's adaptive draft
length sets the next proposal's size from recent acceptance. Here the decision also weighs what
each candidate costs on the device: a round with candidate c is expected to yield

  tokens(c) = 1 + sum of a(u) over c's drafted nodes u + sum of l(j) over c's lookup nodes j

where a(u) is a running estimate of how often drafted node u (a rank path) ends up on the
accepted path, and l(j) the same for the j-th node of the prompt-lookup chain, in rounds where
the context repeats (a lookup exists) and the candidate has a chain; l is kept apart for short
and long matches (`LONG_MATCH` tokens or more), which is known before the round. The loop
verifies the candidate with the largest tokens(c) / cost(c), summed over the active sequences
of the batch (one tree serves the batch); cost(c) is a round with c relative to one with the
root alone (cost 1), measured once per machine (`infer.calibration`) and passed in as
`DecodeConfig.costs`. A candidate's lookup chain is a choice of its own: where a lookup exists,
c is weighed with its chain (tokens and cost with lookup) and without it (as if none were found),
so a chain that is found often but rarely accepted (chat text) is left out rather than paid for
every round. Ties go to the root alone and to no chain, so speculation runs only where it is
expected to pay.

The estimates are exponential moving averages over rounds in which the node was verified:
`DECAY` per round when greedy, `SAMPLED_DECAY` when sampling. Greedy agreement comes in runs
(0.48 after a hit against 0.35 after a miss), and a fast average follows them. A sampled draft
is accepted by a draw, with little run structure: an average moving a fifth per round over
draws accepted half the time strays by 0.17, and on the embedded target at T = 1 it dropped a
draft that pays in about one round of eight; one moving a twentieth strays by 0.08. A node
left out of a round drifts (`DRIFT` per round) back toward its long-run rate: a slower
average over the same rounds (`LONG_RUN` per round), which starts at the node's prior and,
while the node is left out, itself drifts back toward that prior (`LONG_DRIFT` per round). For
a drafted node that average is the mean of its verified rounds, the prior counted as
`PRIOR_ROUNDS` rounds, until the two make 1 / `LONG_RUN` (16 verified rounds): an answer is
about a hundred rounds, and the rank priors (one set for every drafter and temperature) sit
far above what some drafters reach (eagle's and medusa's drafts at T = 1), which kept them
drafting through a third to half of an answer's rounds. A lookup node's estimate is its
long-run rate (below).

So a candidate dropped after a run of misses is tried again a few rounds later, and
kept if its drafts are accepted once more; one whose drafts are rarely accepted over the answer
is tried again only after its long-run rate has climbed back past its cost (about every
20 rounds for a node accepted a tenth of the time). Without that last drift, dropping a
candidate would be for good: its long-run rate only moves when it is verified. Drafted nodes
keep two estimates: for rounds with and without a lookup chain verified next to them (a lookup
chain is tried first, so it takes the drafted nodes' easy tokens).

A lookup chain's acceptance is told by its match, not by the rounds before it. Replayed over the
embedded target's greedy answers (12 each of MT-Bench, ShareGPT and HumanEval, a chain of 8
verified wherever a match exists), a match running back 8 tokens or more had its first token
accepted 0.91-0.96 of the time and 5.7-6.9 of its 8; a shorter one 0.2-0.68 and 1.1-2.4; and
within each kind the round before (a hit or a miss) told nothing more. So l(j) is estimated per
kind of match, as the mean of its verified rounds (the prior weighing `PRIOR_ROUNDS` of them),
then an average moving `LONG_RUN` per round: not the fast greedy average, which after a few
misses on short matches dropped the chain where it paid.

Lossless: the choice depends on tokens already emitted and on no draw of the round it picks, and
every tree is verified and accepted as a fixed one would be.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pspec_jax import tree as tree_lib

__all__ = [
  "DECAY",
  "DRIFT",
  "LONG_DRIFT",
  "LONG_RUN",
  "PRIOR_ROUNDS",
  "SAMPLED_DECAY",
  "Stats",
  "check_costs",
  "choose",
  "default_costs",
  "expected_tokens",
  "init_stats",
  "observe",
  "options",
  "reachable",
  "union_nodes",
  "verified_nodes",
]

DECAY = 0.2  # weight of the newest verified round in a node's estimate, greedy
SAMPLED_DECAY = 0.05  # the same when sampling (T > 0)
DRIFT = 0.1  # per round, how far an unverified node's estimate moves back toward its long run
LONG_RUN = 0.05  # weight of the newest verified round in a node's long-run rate
LONG_DRIFT = 0.005  # per round, how far an unverified node's long-run rate moves to its prior
PRIOR_ROUNDS = 4.0  # the prior weighs as much as this many verified rounds in the long-run rate
LOOKUP_PRIOR = 0.6  # prior of lookup node j after a short match: LOOKUP_PRIOR ** (j + 1)
LONG_MATCH = 8  # a lookup match running back this many tokens or more is a long one
LONG_MATCH_PRIOR = 0.95  # prior of lookup node j after a long match: LONG_MATCH_PRIOR ** (j + 1)
# The cost model of `default_costs` (no calibration): a round with the root alone is 1.
DEFAULT_NODE_COST = 0.1  # each verified node past the root
DEFAULT_DRAFT_COST = 0.1  # a draft pass (eagle: per level)


@struct.dataclass
class Stats:
  """The loop's running acceptance statistics and the candidate it picked."""

  choice: jax.Array  # [] int32: the candidate drafted for (and verified in) the next round
  chain: jax.Array  # [] bool: whether that round verifies its lookup chain (where one is found)
  drafted: jax.Array  # [B, 2, Md - 1] a(u) for the drafted non-root nodes, without / with lookup
  lookup: jax.Array  # [B, 2, L] l(j) after a short / a long match
  drafted_long: jax.Array  # [B, 2, Md - 1] the long-run rates the estimates drift back to
  lookup_long: jax.Array  # [B, 2, L]
  drafted_rounds: jax.Array  # [B, 2, Md - 1] float32 rounds that verified each drafted node
  lookup_rounds: jax.Array  # [B, 2, L] float32 rounds that verified each lookup node
  chosen: jax.Array  # [C] int32 rounds verified with each candidate
  chained: jax.Array  # [C] int32 those of them that also verified its lookup chain
  costs: jax.Array  # [2, C] a round's cost with each candidate, without / with its lookup chain
  decay: jax.Array  # [] float32: the estimates' weight of a newly verified round


def _members(pool: tree_lib.Tree) -> np.ndarray:
  """[C, Md - 1] bool: which drafted non-root nodes of the union each candidate has."""
  index = {p: i for i, p in enumerate(pool.paths)}
  out = np.zeros((len(pool.candidates), len(pool.paths)), bool)
  for c, cand in enumerate(pool.candidates):
    out[c, [index[p] for p in cand.paths]] = True
  return out


def _lookups(pool: tree_lib.Tree) -> np.ndarray:
  """[C] int32: each candidate's lookup chain length."""
  return np.asarray([c.lookup for c in pool.candidates], np.int32)


def _priors(pool: tree_lib.Tree) -> tuple[np.ndarray, np.ndarray]:
  drafted = np.asarray(
    [
      math.prod(tree_lib.RANK_PRIOR[min(r, len(tree_lib.RANK_PRIOR) - 1)] for r in p)
      for p in pool.paths
    ],
    np.float32,
  )
  j = np.arange(1, pool.lookup + 1, dtype=np.float32)
  lookup = np.stack([LOOKUP_PRIOR**j, LONG_MATCH_PRIOR**j]).astype(np.float32)
  return drafted, lookup


def init_stats(
  pool: tree_lib.Tree, batch: int, costs: tuple[tuple[float, float], ...], greedy: bool = True
) -> Stats:
  """Every estimate at its prior; the root alone chosen; the estimates moving `DECAY` per
  verified round when `greedy`, else `SAMPLED_DECAY`. The costs (`DecodeConfig.costs`) ride in
  the state, not in the compiled program: new ones need no compilation."""
  drafted, lookup = _priors(pool)
  drafted = jnp.broadcast_to(jnp.asarray(drafted), (batch, 2, len(drafted)))
  lookup = jnp.broadcast_to(jnp.asarray(lookup), (batch, *lookup.shape))
  return Stats(
    choice=jnp.zeros((), jnp.int32),
    chain=jnp.zeros((), jnp.bool_),
    drafted=drafted,
    lookup=lookup,
    drafted_long=drafted,
    lookup_long=lookup,
    drafted_rounds=jnp.zeros_like(drafted),
    lookup_rounds=jnp.zeros_like(lookup),
    chosen=jnp.zeros((len(pool.candidates),), jnp.int32),
    chained=jnp.zeros((len(pool.candidates),), jnp.int32),
    costs=jnp.asarray(costs, jnp.float32).T,
    decay=jnp.float32(DECAY if greedy else SAMPLED_DECAY),
  )


def options(pool: tree_lib.Tree) -> list[tuple[int, bool]]:
  """The (candidate, chain) options an adaptive round runs: each candidate without its lookup
  chain, and with it where it has one. A candidate that is a chain alone (`lookup:N`) is the root
  alone without it: that is the root's option, not one of its own (each option is one more
  compiled round, 3-5 s of compilation for the embedded default on a 2-core CPU)."""
  alone = [(c, False) for c, cand in enumerate(pool.candidates) if c == 0 or cand.depth > 0]
  return alone + [(c, True) for c, cand in enumerate(pool.candidates) if cand.lookup]


def verified_nodes(pool: tree_lib.Tree) -> list[tuple[int, int]]:
  """Per candidate, the nodes a round verifies without and with its lookup chain."""
  return [(c.num_nodes, c.num_nodes + c.lookup) for c in pool.candidates]


def union_nodes(pool: tree_lib.Tree) -> list[np.ndarray]:
  """Per candidate, the union's index of each of its nodes, in the candidate's own order: the
  root, its drafted nodes, then its lookup chain (after the union's drafted nodes, as
  `tree.with_lookup` places it)."""
  union = {p: i + 1 for i, p in enumerate(pool.paths)}
  drafted = pool.num_nodes
  return [
    np.asarray([0, *(union[p] for p in c.paths), *range(drafted, drafted + c.lookup)], np.int32)
    for c in pool.candidates
  ]


def expected_tokens(stats: Stats, pool: tree_lib.Tree, match_B: jax.Array) -> jax.Array:
  """[B, 2, C] expected tokens of a round with each candidate, without and with its lookup
  chain. `match_B`: how far back each sequence's lookup match runs (0: none found, the chain
  does not run; a bool: found or not, a short match)."""
  members = jnp.asarray(_members(pool))  # [C, U]
  lengths = jnp.asarray(_lookups(pool))
  found_B = match_B > 0
  long_B = match_B >= LONG_MATCH
  runs_BC = found_B[:, None] & (lengths > 0)[None, :]
  # Masked sums, not matmuls: exact whatever the matmul precision.
  drafted_BC2 = jnp.where(members[None, :, None, :], stats.drafted[:, None], 0.0).sum(-1)
  in_chain_CL = jnp.arange(pool.lookup)[None, :] < lengths[:, None]
  lookup_BL = jnp.where(long_B[:, None], stats.lookup[:, 1], stats.lookup[:, 0])
  lookup_BC = jnp.where(in_chain_CL[None], lookup_BL[:, None, :], 0.0).sum(-1)
  without = 1.0 + drafted_BC2[..., 0]
  with_chain = jnp.where(runs_BC, 1.0 + drafted_BC2[..., 1] + lookup_BC, without)
  return jnp.stack([without, with_chain], axis=1)


def choose(
  stats: Stats,
  pool: tree_lib.Tree,
  match_B: jax.Array,
  active_B: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The next round: ([] candidate, [] whether it verifies its lookup chain), the option of
  most expected tokens per cost over the active sequences (`match_B` as `expected_tokens`
  takes it). A chain found but expected to yield less than it costs is left out, as a drafted
  candidate is. Ties go to the root alone and to leaving the chain out; so does a batch with no
  active sequence."""
  tokens_2C = jnp.where(active_B[:, None, None], expected_tokens(stats, pool, match_B), 0.0)
  tokens_2C = tokens_2C.sum(0)
  lengths = jnp.asarray(_lookups(pool))
  lookup_runs = jnp.any(active_B & (match_B > 0)) & (lengths > 0)
  ratio_2C = tokens_2C / stats.costs
  # A candidate without a chain that runs has no second option: its first one stands.
  ratio_2C = ratio_2C.at[1].set(jnp.where(lookup_runs, ratio_2C[1], -jnp.inf))
  runs_2C = np.zeros((2, len(pool.candidates)), bool)
  for c, chain in options(pool):
    runs_2C[int(chain), c] = True
  ratio_2C = jnp.where(runs_2C, ratio_2C, -jnp.inf)
  best = jnp.argmax(ratio_2C.reshape(-1)).astype(jnp.int32)
  num = len(pool.candidates)
  return best % num, best >= num


def reachable(tree: tree_lib.TreeArrays, depth: int) -> jax.Array:
  """[B, M] which nodes the (cut) tree links to from its root: those a round verified."""
  kids = tree.children  # [B, M, C]
  batch, m = kids.shape[:2]
  reach = jnp.zeros((batch, m), jnp.bool_).at[:, 0].set(True)
  is_node = kids[..., None] == jnp.arange(m)  # [B, M, C, M]
  for _ in range(depth):
    reach = reach | jnp.any(is_node & reach[:, :, None, None], axis=(1, 2))
  return reach


def observe(
  stats: Stats,
  pool: tree_lib.Tree,
  reach: jax.Array,
  path_BP1: jax.Array,
  num_accepted_B: jax.Array,
  active_B: jax.Array,
  match_B: jax.Array | None = None,
) -> Stats:
  """The estimates after a round that verified the union's nodes `reach` [B, M] and accepted
  `path` (union indices; active sequences); its lookup chain's under the kind of match it came
  from (`match_B` as `expected_tokens` takes it; None: no chain ran)."""
  m = reach.shape[1]
  depth = path_BP1.shape[1] - 1
  on_path = jnp.any(
    (path_BP1[:, 1:, None] == jnp.arange(m))
    & (jnp.arange(depth)[None, :, None] < num_accepted_B[:, None, None]),
    axis=1,
  )
  drafted = pool.num_nodes
  with_lookup = jnp.any(reach[:, drafted:], axis=1)
  table_B2 = jnp.stack([~with_lookup, with_lookup], axis=1)
  seen = reach[:, None, 1:drafted] & table_B2[:, :, None]

  def update(old, long, rounds, prior, seen, hit, decay):
    """(estimate, long-run rate, rounds) after the round: the estimate moves `decay` toward
    the outcome where the node was verified, and the long-run rate as the mean of its first
    verified rounds (and `PRIOR_ROUNDS` of the prior), then `LONG_RUN` a round; elsewhere the
    estimate drifts toward the long-run rate, and that, slowly, toward the prior. `decay`
    None: the estimate is the long-run rate."""
    hit = hit.astype(jnp.float32)
    active = active_B.reshape(active_B.shape + (1,) * (old.ndim - 1))
    weight = jnp.maximum(LONG_RUN, 1.0 / (PRIOR_ROUNDS + rounds + 1.0))
    rounds = jnp.where(active, rounds + seen, rounds)
    decay = weight if decay is None else decay
    new = jnp.where(seen, old + decay * (hit - old), old + DRIFT * (long - old))
    new_long = jnp.where(seen, long + weight * (hit - long), long + LONG_DRIFT * (prior - long))
    return jnp.where(active, new, old), jnp.where(active, new_long, long), rounds

  prior_u, prior_j = _priors(pool)
  drafted_u, drafted_long, drafted_rounds = update(
    stats.drafted,
    stats.drafted_long,
    stats.drafted_rounds,
    prior_u,
    seen,
    on_path[:, None, 1:drafted],
    stats.decay,
  )
  long_B = jnp.zeros_like(active_B) if match_B is None else match_B >= LONG_MATCH
  kind_B2 = jnp.stack([~long_B, long_B], axis=1)
  lookup_j, lookup_long, lookup_rounds = update(
    stats.lookup,
    stats.lookup_long,
    stats.lookup_rounds,
    prior_j,
    reach[:, None, drafted:] & kind_B2[:, :, None],
    on_path[:, None, drafted:],
    None,
  )
  any_active = jnp.any(active_B).astype(jnp.int32)
  return stats.replace(
    drafted=drafted_u,
    lookup=lookup_j,
    drafted_long=drafted_long,
    lookup_long=lookup_long,
    drafted_rounds=drafted_rounds,
    lookup_rounds=lookup_rounds,
    chosen=stats.chosen.at[stats.choice].add(any_active),
    chained=stats.chained.at[stats.choice].add(jnp.any(with_lookup & active_B).astype(jnp.int32)),
  )


def default_costs(pool: tree_lib.Tree, kind: str) -> tuple[tuple[float, float], ...]:
  """An uncalibrated guess of each candidate's cost (the root alone is 1): `DEFAULT_NODE_COST`
  per verified node past the root and `DEFAULT_DRAFT_COST` per draft pass (eagle drafts one
  pass per level). `infer.calibration` measures the real ones."""
  out = []
  for cand, (n0, n1) in zip(pool.candidates, verified_nodes(pool), strict=True):
    passes = cand.depth if kind == "eagle" else min(cand.depth, 1)
    draft = 0.0 if kind == "pld" else DEFAULT_DRAFT_COST * passes
    out.append(tuple(1.0 + draft + DEFAULT_NODE_COST * (n - 1) for n in (n0, n1)))
  return tuple(out)


def check_costs(pool: tree_lib.Tree, costs) -> None:
  """One clear ValueError unless `costs` has a (without, with lookup) pair > 0 per candidate."""
  ok = len(costs) == len(pool.candidates) and all(
    len(pair) == 2 and all(isinstance(x, float | int) and x > 0 for x in pair) for pair in costs
  )
  if not ok:
    raise ValueError(
      f"DecodeConfig.costs must give {len(pool.candidates)} (without, with lookup) cost pairs > "
      f"0, one per candidate of {pool.spec!r} (the root alone first), got {costs!r}"
    )
