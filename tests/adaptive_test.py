"""Adaptive rounds: lossless for every drafter kind, and the choice on fake costs and histories."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import adaptive, decode, propose, testing, tree_specs
from pspec_jax.drafter import read_target

KINDS = ("pspec", "eagle", "medusa", "pld")
TREES = ("adaptive", "adaptive:paths:0/1|chain+lookup:3|lookup:2")


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


def eos_mid_round(target):
  """An EOS id that a plain decode of testing.PROMPTS emits mid-answer (rounds accept past it)."""
  tokens, lengths = testing.padded(testing.PROMPTS)
  plain = decode.generate(
    target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(max_new_tokens=30)
  )
  return int(plain.tokens[0, 9])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
  "tree,rows", [(TREES[0], slice(0, 4)), (TREES[1], slice(0, 4)), (TREES[1], slice(2, 3))]
)
def test_adaptive_greedy_equals_plain_greedy(target, kind, tree, rows):
  tokens, lengths = testing.padded(testing.PROMPTS[rows])
  cfg = decode.DecodeConfig(max_new_tokens=30, eos_ids=(eos_mid_round(target),), tree=tree)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  spec = decode.generate(
    target, tokens, lengths, jax.random.key(0), cfg, testing.drafter_for(kind, target)
  )
  assert spec.tokens.tolist() == plain.tokens.tolist()
  assert spec.lengths.tolist() == plain.lengths.tolist()
  np.testing.assert_allclose(spec.tau * spec.rounds, spec.lengths - 1, rtol=1e-6)
  # One choice per round of the batch, and rounds that drafted did so.
  assert int(spec.chosen.sum()) == int(spec.rounds.max())
  assert spec.chosen[1:].sum() > 0 and (spec.tau > 1).any()
  # Rounds that verified a chain are some of their candidate's; a candidate without one has none.
  pool = decode.resolve_tree(cfg, testing.drafter_for(kind, target))
  has_chain = np.asarray([c.lookup > 0 for c in pool.candidates])
  assert (spec.chained <= spec.chosen).all() and (spec.chained[~has_chain] == 0).all()


@pytest.mark.parametrize("kind", ["pspec", "eagle"])
def test_rounds_that_draft_nothing_leave_their_pairs_pending(target, kind):
  """Rounds that verify no drafted node do not run the drafter: their pairs wait in a buffer
  and go in with the next drafting round's pass (or a feed once it fills). Every pair is in the
  drafter's cache or pending, and once the last ones go in, the cache holds what a drafter
  that took every pair in at once holds."""
  drafter = testing.drafter_for(kind, target).with_head(target)
  tokens, lengths = testing.padded(testing.PROMPTS[:2])
  tree = "adaptive:paths:0/1|lookup:2"  # drafting costs little: it alternates with the root
  cfg = decode.DecodeConfig(max_new_tokens=60, tree=tree, costs=((1, 1), (1.1, 1.1), (1, 1.2)))
  plan = decode.make_plan(cfg, drafter, tokens.shape[1])
  costs = decode.costs(cfg, plan)
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0), costs)
  waited = drafted_after_waiting = 0
  while not bool(state.done.all()):
    waiting = int(state.pending.count.max()) > 1  # more than the last round's pairs
    waited += waiting
    drafted_after_waiting += waiting and int(state.adapt.choice) == 1
    state = decode.round_step(plan, target, drafter, state)
    # Pair t is (h_t, x_{t+1}): one per known token but the first.
    in_cache = state.drafter_cache.lengths + state.pending.count
    assert in_cache.tolist() == (state.num_tokens - 1).tolist()
  assert waited > 0 and drafted_after_waiting > 0
  plain = decode.generate(
    target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(max_new_tokens=60)
  )
  out = decode.finish(plan, state)
  assert out.tokens.tolist() == plain.tokens.tolist()
  # The cache after the last pairs go in, against one pass over every pair.
  cache = propose.feed(drafter, target, state.drafter_cache, state.pending)
  n = state.num_tokens - 1
  width = int(n.max())
  positions = jnp.broadcast_to(jnp.arange(width), (2, width))
  _, features, _ = read_target(target, drafter.cfg, state.tokens[:, :width], positions)
  pairs = propose.Pairs(tokens=state.tokens[:, 1 : width + 1], features=features, count=n)
  at_once = propose.feed(drafter, target, drafter.empty_cache(2, plan.max_len), pairs)
  assert cache.lengths.tolist() == at_once.lengths.tolist() == n.tolist()
  for b in range(2):
    for got, want in zip(jax.tree.leaves(cache.k), jax.tree.leaves(at_once.k), strict=True):
      np.testing.assert_allclose(got[b, : n[b]], want[b, : n[b]], rtol=1e-4, atol=1e-5)


def test_a_chain_left_out_is_no_part_of_the_round(target):
  """Pinned (by its costs) to `paths:0+lookup:3` without its chain, every round verifies the
  drafted tree alone, though chains are found; pinned with it, rounds verify chains."""
  tokens, lengths = testing.padded(testing.PROMPTS)
  drafter = testing.drafter_for("pspec", target)
  plain = decode.generate(
    target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(max_new_tokens=30)
  )
  out = {}
  for chain, costs in [(False, ((1e3, 1e3), (1.0, 1e3))), (True, ((1e3, 1e3), (1e3, 1.0)))]:
    cfg = decode.DecodeConfig(max_new_tokens=30, tree="adaptive:paths:0+lookup:3", costs=costs)
    out[chain] = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
    assert out[chain].tokens.tolist() == plain.tokens.tolist()
  assert out[False].chosen.tolist() == [0, int(out[False].rounds.max())]
  assert out[False].chained.tolist() == [0, 0]
  assert out[True].chained[1] > 0
  # Only a chain reaches below depth 1.
  assert out[False].accepted_per_depth[:, 1:].sum() == 0 < out[True].accepted_per_depth[:, 1:].sum()


def test_a_candidate_that_costs_too_much_is_never_chosen(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  tree = "adaptive:chain|lookup:3"
  drafter = testing.drafter_for("pspec", target)
  # Candidates: the root alone, chain, lookup:3; the chain costs as much as 6 plain rounds,
  # more than its 5 tokens at best.
  cfg = decode.DecodeConfig(max_new_tokens=30, tree=tree, costs=((1, 1), (6, 6), (1.2, 1.3)))
  out = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  assert out.chosen.tolist()[1] == 0 and out.chosen[2] > 0
  # Every candidate at cost 1 ties the root alone at worst: drafting is chosen.
  cheap = decode.DecodeConfig(max_new_tokens=30, tree=tree, costs=((1, 1),) * 3)
  assert decode.generate(target, tokens, lengths, jax.random.key(0), cheap, drafter).chosen[1] > 0


def test_bad_costs_are_one_clear_error(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(tree="adaptive:chain", costs=((1, 1),))
  with pytest.raises(ValueError, match="costs must give 2"):
    decode.generate(
      target, tokens, lengths, jax.random.key(0), cfg, testing.drafter_for("pld", target)
    )
  with pytest.raises(ValueError, match="costs must be"):
    decode.DecodeConfig(costs=(1.0,))


# --- the choice on fake costs and acceptance histories ----------------------------------------

POOL = tree_specs.parse("adaptive:paths:0|chain", 4)  # the root alone, (0,), the chain of 4
COSTS = ((1.0, 1.0), (1.4, 1.4), (1.9, 1.9))


def fake_round(stats, hits: bool, active=(True,)):
  """A round with the chosen candidate in which every verified draft is accepted (`hits`) or
  none is; returns the stats after it."""
  batch = len(active)
  chosen = POOL.candidates[int(stats.choice)]
  verified = adaptive.union_nodes(POOL)[int(stats.choice)]
  reach = jnp.zeros((batch, POOL.num_nodes), jnp.bool_).at[:, verified].set(True)
  index = {p: i + 1 for i, p in enumerate(POOL.paths)}
  accepted = chosen.depth if hits else 0
  path = [0] + [index[(0,) * d] for d in range(1, accepted + 1)]
  path += [path[-1]] * (POOL.max_depth + 1 - len(path))
  path_BP1 = jnp.asarray([path] * batch, jnp.int32)
  return adaptive.observe(
    stats, POOL, reach, path_BP1, jnp.full((batch,), accepted), jnp.asarray(active)
  )


def test_rounds_that_verify_a_lookup_chain_are_counted_apart():
  pool = tree_specs.parse("adaptive:paths:0+lookup:2", 4)
  stats = adaptive.init_stats(pool, 2, ((1.0, 1.0), (1.2, 1.5))).replace(choice=jnp.int32(1))
  drafted = jnp.asarray([[True, True, False, False]] * 2)
  chain_in_0 = drafted.at[0, 2:].set(True)  # sequence 0's tree has its chain, 1's does not
  path, accepted = jnp.zeros((2, pool.max_depth + 1), jnp.int32), jnp.zeros((2,), jnp.int32)
  for reach, active, chained in [
    (drafted, [True, True], 0),  # no sequence found a chain
    (chain_in_0, [False, True], 0),  # only a finished sequence did
    (chain_in_0, [True, True], 1),
  ]:
    stats = adaptive.observe(stats, pool, reach, path, accepted, jnp.asarray(active))
    assert stats.chained.tolist()[1] == chained
    stats = stats.replace(chained=jnp.zeros_like(stats.chained))
  assert stats.chosen.tolist() == [0, 3]


def next_choice(stats, active=(True,)):
  found = jnp.zeros((len(active),), jnp.bool_)
  choice, chain = adaptive.choose(stats, POOL, found, jnp.asarray(active))
  return stats.replace(choice=choice, chain=chain)


def test_drafts_stop_when_rejected_and_resume_when_accepted_again():
  stats = next_choice(adaptive.init_stats(POOL, 1, COSTS))
  assert int(stats.choice) > 0  # the priors promise more than the costs
  # Every draft rejected: the root alone within a few rounds.
  rounds = 0
  while int(stats.choice) > 0 and rounds < 10:
    stats = next_choice(fake_round(stats, hits=False))
    rounds += 1
  assert int(stats.choice) == 0 and rounds <= 4
  # Nothing drafted for a while: the estimates drift back until a candidate is tried again
  # (within about a dozen rounds: a few misses move the long-run rates only part of the way
  # from their priors) ...
  waited = 0
  while int(stats.choice) == 0 and waited < 200:
    stats = next_choice(fake_round(stats, hits=True))  # the root alone verifies no draft
    waited += 1
  assert int(stats.choice) > 0 and waited <= 15
  # ... and, accepted again, drafting goes on.
  choices = []
  for _ in range(10):
    stats = next_choice(fake_round(stats, hits=True))
    choices.append(int(stats.choice))
  assert all(c > 0 for c in choices)
  assert stats.chosen.tolist()[0] > 0 and sum(stats.chosen.tolist()) == rounds + waited + 10


@pytest.mark.parametrize(("rate", "most"), [(0.1, 20), (0.2, 40)])
def test_drafts_rarely_accepted_are_seldom_tried_again(rate, most):
  """The chain of 4 pays from an acceptance of 0.225 (cost 1.9) and (0,) from 0.4 (cost 1.4);
  their drafts are accepted at `rate`. They are tried again now and then, never for good
  (their long-run rates climb back to the prior while they are left out), but on at most
  `most` of rounds 200-400: a tenth of the rounds at 0.1, a fifth at 0.2."""
  stats = next_choice(adaptive.init_stats(POOL, 1, COSTS))
  drafted = []
  for _ in range(400):
    tried = int(stats.choice) > 0
    hit = tried and (sum(drafted) + 1) % round(1 / rate) == 0
    drafted.append(tried)
    stats = next_choice(fake_round(stats, hits=hit))
  assert 0 < sum(drafted[200:]) <= most
  assert sum(drafted[300:]) > 0  # not dropped for good


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_drafts_rarely_accepted_are_dropped_early_in_an_answer(rate):
  """A short answer is about a hundred rounds: a candidate's optimistic prior must not keep it
  drafting through them. The long-run rate is a mean over the first verified rounds (the prior
  weighing `PRIOR_ROUNDS` of them), so drafts accepted a tenth of the time or never are tried
  in a handful of those rounds (an average moving a twentieth per round tried them 11-14
  times)."""
  stats = next_choice(adaptive.init_stats(POOL, 1, COSTS))
  drafted = []
  for _ in range(100):
    tried = int(stats.choice) > 0
    hit = tried and rate > 0 and (sum(drafted) + 1) % round(1 / rate) == 0
    drafted.append(tried)
    stats = next_choice(fake_round(stats, hits=hit))
  assert 0 < sum(drafted) <= 6


ONE = tree_specs.parse("adaptive:paths:0", 4)  # the root alone, or one drafted token
ONE_COSTS = ((1.0, 1.0), (1.18, 1.18))  # drafting pays from an acceptance of 0.18 up


def one_round(stats, hit: bool):
  """A round with `ONE`'s chosen candidate: its draft (if any) accepted where `hit`; then the
  next choice."""
  drafted = int(stats.choice) > 0
  reach = jnp.zeros((1, ONE.num_nodes), jnp.bool_).at[:, : 1 + drafted].set(True)
  accepted = int(drafted and hit)
  path = jnp.asarray([[0, accepted]], jnp.int32)
  stats = adaptive.observe(stats, ONE, reach, path, jnp.asarray([accepted]), jnp.asarray([True]))
  choice, chain = adaptive.choose(stats, ONE, jnp.zeros((1,), jnp.bool_), jnp.asarray([True]))
  return stats.replace(choice=choice, chain=chain)


def test_sampled_drafts_that_pay_are_not_dropped_by_chance():
  """At T > 0 a draft is accepted by a draw: here with probability 0.45, at random, where
  drafting pays from 0.18 up. The greedy average (a fifth per round) follows chance runs of
  misses below that and drops the draft now and then; the sampling one (a twentieth) keeps
  drafting (0 of 400 rounds dropped, against 45). Once no draft is accepted, both stop: the
  greedy one within a few rounds (6 here), the sampling one within a few tens (18)."""
  hits = np.random.default_rng(0).random(400) < 0.45
  dropped = {}
  for greedy in (True, False):
    stats = adaptive.init_stats(ONE, 1, ONE_COSTS, greedy)
    assert float(stats.decay) == pytest.approx(adaptive.DECAY if greedy else adaptive.SAMPLED_DECAY)
    stats = one_round(stats, hit=False)  # the first round: the root alone, then the choice
    choices = []
    for hit in hits:
      choices.append(int(stats.choice))
      stats = one_round(stats, hit)
    dropped[greedy] = choices.count(0)
    rounds = 0
    while int(stats.choice) > 0 and rounds < 100:
      stats = one_round(stats, hit=False)
      rounds += 1
    assert int(stats.choice) == 0 and rounds <= (8 if greedy else 30), (greedy, rounds)
  assert dropped[False] <= 4 < dropped[True], dropped


def test_the_choice_weighs_tokens_against_costs():
  stats = adaptive.init_stats(POOL, 2, COSTS)
  # a(0,) = 0.5 and a(0,0) = 0.4, deeper 0: (0,) gives 1.5 tokens for 1.4, the chain 1.9 for 1.9.
  rates = jnp.asarray([0.5, 0.4, 0.0, 0.0])
  stats = stats.replace(drafted=jnp.broadcast_to(rates, stats.drafted.shape))
  found, both = jnp.zeros((2,), jnp.bool_), jnp.asarray([True, True])
  tokens = adaptive.expected_tokens(stats, POOL, found)
  np.testing.assert_allclose(tokens, [[[1, 1.5, 1.9]] * 2] * 2, rtol=1e-6)
  assert int(adaptive.choose(stats, POOL, found, both)[0]) == 1
  # Costs that make (0,) lose: the root alone, even though (0,) is accepted half the time.
  costly = jnp.asarray(((1.0, 1.0), (1.6, 1.6), (2.5, 2.5))).T
  stats = stats.replace(costs=costly)
  assert int(adaptive.choose(stats, POOL, found, both)[0]) == 0
  # Finished sequences do not count: one sure sequence left decides the batch alone.
  sure = stats.drafted.at[1].set(1.0)
  stats = stats.replace(drafted=sure)
  assert int(adaptive.choose(stats, POOL, found, jnp.asarray([False, True]))[0]) == 2
  assert int(adaptive.choose(stats, POOL, found, jnp.asarray([False, False]))[0]) == 0


def test_a_lookup_match_makes_the_lookup_candidates_pay():
  pool = tree_specs.parse("adaptive:paths:0|lookup:3", 4)
  costs = ((1.0, 1.0), (1.4, 1.4), (1.0, 1.3))
  stats = adaptive.init_stats(pool, 1, costs)
  stats = stats.replace(drafted=jnp.full_like(stats.drafted, 0.3))
  active = jnp.asarray([True])
  no_match, match = jnp.asarray([False]), jnp.asarray([True])
  assert [int(x) for x in adaptive.choose(stats, pool, no_match, active)] == [0, 0]
  assert [int(x) for x in adaptive.choose(stats, pool, match, active)] == [2, 1]


def test_a_chain_that_does_not_pay_is_left_out():
  """A match is found, but the chain's nodes are rarely accepted: the drafted candidate runs
  without its chain (the chain would cost more than it yields), or with it once it pays."""
  pool = tree_specs.parse("adaptive:lookup:3|paths:0+lookup:3", 4)
  costs = ((1.0, 1.0), (1.0, 1.3), (1.2, 1.5))
  stats = adaptive.init_stats(pool, 1, costs)
  stats = stats.replace(
    drafted=jnp.full_like(stats.drafted, 0.6), lookup=jnp.full_like(stats.lookup, 0.05)
  )
  active, match = jnp.asarray([True]), jnp.asarray([True])
  # paths:0 alone: 1.6 / 1.2 = 1.33; with the chain 1.75 / 1.5; the chain alone 1.15 / 1.3.
  assert [int(x) for x in adaptive.choose(stats, pool, match, active)] == [2, 0]
  stats = stats.replace(lookup=jnp.full_like(stats.lookup, 0.5))  # 3.1 / 1.5 against 2.5 / 1.3
  assert [int(x) for x in adaptive.choose(stats, pool, match, active)] == [2, 1]
  # Nothing pays: the root alone, and no chain.
  stats = stats.replace(
    drafted=jnp.full_like(stats.drafted, 0.1), lookup=jnp.full_like(stats.lookup, 0.05)
  )
  assert [int(x) for x in adaptive.choose(stats, pool, match, active)] == [0, 0]


def test_a_long_match_is_weighed_apart_from_short_ones():
  """A lookup chain's acceptance goes with how far back its match runs: a copied line (a long
  match) is accepted far more often than a two-token match. Prompt lookup's set (`lookup:4` and
  `lookup:8`, 1.55 and 2.05 root-alone rounds): the priors take the short chain after a short
  match and the long one after a long match; short matches that are never accepted drop their
  chain, and a long match still takes the long one."""
  pool = tree_specs.parse("adaptive:lookup:4|lookup:8", 4)
  stats = adaptive.init_stats(pool, 1, ((1.0, 1.0), (1.0, 1.55), (1.0, 2.05)))
  active, short, long = jnp.asarray([True]), jnp.asarray([2]), jnp.asarray([adaptive.LONG_MATCH])

  def pick(stats, match):
    choice, chain = adaptive.choose(stats, pool, match, active)
    return stats.replace(choice=choice, chain=chain)

  assert [int(x) for x in adaptive.choose(stats, pool, short, active)] == [1, 1]
  assert [int(x) for x in adaptive.choose(stats, pool, long, active)] == [2, 1]
  stats, misses = pick(stats, short), 0
  while int(stats.choice) and misses < 50:  # the short chain verified, never accepted
    nodes = adaptive.union_nodes(pool)[int(stats.choice)]
    reach = jnp.zeros((1, pool.num_nodes + pool.lookup), jnp.bool_).at[:, nodes].set(True)
    path = jnp.zeros((1, pool.max_depth + 1), jnp.int32)
    stats = adaptive.observe(stats, pool, reach, path, jnp.asarray([0]), active, short)
    stats = pick(stats, short)
    misses += 1
  # Dropped after a few misses (the estimate is the mean of the rounds so far, the prior weighing
  # four), and the long matches' estimates are as they were.
  assert 4 <= misses <= 12 and int(stats.choice) == 0
  np.testing.assert_array_equal(
    stats.lookup[:, 1], adaptive.init_stats(pool, 1, ((1, 1),) * 3).lookup[:, 1]
  )
  assert [int(x) for x in adaptive.choose(stats, pool, long, active)] == [2, 1]


def test_a_chain_alone_without_its_chain_is_the_root_alone():
  """`lookup:3` without its chain verifies the root alone: no option (no compiled round) of its
  own, and never chosen, even at a cost below the root's; with the chain it is an option."""
  pool = tree_specs.parse("adaptive:lookup:3|paths:0+lookup:3|paths:0/1", 4)
  assert adaptive.options(pool) == [(0, False), (2, False), (3, False), (1, True), (2, True)]
  stats = adaptive.init_stats(pool, 1, ((1.0, 1.0), (0.5, 1.3), (1.2, 1.5), (1.3, 1.3)))
  stats = stats.replace(
    drafted=jnp.zeros_like(stats.drafted), lookup=jnp.full_like(stats.lookup, 0.5)
  )
  active, found = jnp.asarray([True]), jnp.asarray([True])
  # Cheaper than the root, yet the root: the chain alone runs only with its chain.
  assert [int(x) for x in adaptive.choose(stats, pool, ~found, active)] == [0, 0]
  assert [int(x) for x in adaptive.choose(stats, pool, found, active)] == [1, 1]


# --- spelling: trees and drafter files ---------------------------------------------------------


def test_an_adaptive_tree_is_the_union_of_its_candidates_and_the_root_alone():
  pool = tree_specs.parse("adaptive:paths:0/1|chain+lookup:3|lookup:2", 4)
  assert [c.spec for c in pool.candidates] == [
    "paths:",
    "paths:0/1",
    "paths:0/0.0/0.0.0/0.0.0.0+lookup:3",
    "lookup:2",
  ]
  assert pool.paths == ((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)) and pool.lookup == 3
  assert tree_specs.parse(pool.spec, 4) == pool
  nodes = [n.tolist() for n in adaptive.union_nodes(pool)]
  assert nodes[1] == [0, 1, 2]  # paths:0/1
  assert nodes[2] == [0, 1, 3, 4, 5, 6, 7, 8]  # the chain, then its lookup after the drafted 6
  assert nodes[3] == [0, 6, 7]  # lookup:2: the root, then the chain's first 2
  # The default set, less what K allows.
  assert tree_specs.parse("adaptive", 1).spec == "adaptive:lookup:1|paths:0+lookup:1"
  for bad, message in [
    ("adaptive:dynamic:4", "static tree without a gate"),
    ("adaptive:paths:0+min:0.2", "static tree without a gate"),
    ("adaptive:adaptive", "cannot be adaptive"),
    ("adaptive:paths:0/0.0/0.0.0", "deeper than K=2"),
  ]:
    with pytest.raises(ValueError, match=message):
      tree_specs.parse(bad, 2)


def test_a_drafter_file_keeps_its_adaptive_candidates(target, tmp_path):
  from pspec_jax import drafter_files

  drafter = testing.drafter_for("medusa", target)
  drafter = drafter.replace(cfg=drafter.cfg.replace(tree="adaptive", adaptive="paths:0|lookup:3"))
  drafter_files.save_drafter(str(tmp_path), drafter)
  loaded = drafter_files.load_drafter(str(tmp_path), target)
  assert loaded.cfg.adaptive == "paths:0|lookup:3"
  pool = decode.resolve_tree(decode.DecodeConfig(), loaded)
  assert [c.spec for c in pool.candidates] == ["paths:", "paths:0", "lookup:3"]
  with pytest.raises(ValueError, match="unknown tree 'bushy'"):
    drafter.cfg.replace(adaptive="bushy")


def test_stream_equals_generate_with_an_adaptive_tree(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=20, eos_ids=(3,), tree=TREES[1])
  drafter = testing.drafter_for("eagle", target)
  out = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  pieces = [[] for _ in testing.PROMPTS]
  for new in decode.stream(target, tokens, lengths, jax.random.key(0), cfg, drafter):
    for row, ids in enumerate(new):
      pieces[row].extend(ids.tolist())
  for row in range(len(testing.PROMPTS)):
    assert pieces[row] == out.tokens[row, : out.lengths[row]].tolist()
