"""Drafts drawn from the drafter's q: recursive rejection sampling against an exhaustive
reference, sibling draws without replacement, and whole decodes against the target's exact
distribution (chi-square)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from pspec_jax import accept, decode, testing, tree_specs
from pspec_jax import propose as propose_lib
from pspec_jax.sampling import SamplingConfig, filtered_logits

# --- the recursive rejection step, exhaustively -----------------------------------------------


def ordered_draws(q, k):
  """Every ordered k-tuple of distinct tokens with its probability of being drawn from q
  without replacement (each draw from q renormalised over the tokens not drawn yet)."""
  support = np.flatnonzero(q > 0)
  for draw in itertools.permutations(support, k):
    prob, left = 1.0, 1.0
    for x in draw:
      prob *= q[x] / left
      left -= q[x]
    yield draw, prob


def reference_output(p, q, siblings, renormalise=True):
  """Exact distribution of the emitted token when `siblings` are tried by recursive rejection
  sampling: a sibling (x, True) was drawn from q without replacement, (x, False) is a point
  mass (a prompt-lookup node). Written from the paper's equations, in float64; `renormalise`
  False leaves the proposal q as it was (the mistake the check must catch)."""
  out = np.zeros_like(p)
  r, q_left, reach = p.copy(), q.copy(), 1.0
  for x, drawn in siblings:
    pi = q_left / q_left.sum() if drawn else np.eye(len(p))[x]
    accept_prob = min(1.0, r[x] / pi[x])
    out[x] += reach * accept_prob
    reach *= 1 - accept_prob
    if reach == 0:
      return out
    residual = np.maximum(r - pi, 0)
    r = residual / residual.sum()
    if drawn and renormalise:
      q_left[x] = 0
  return out + reach * r


def random_pair(rng, vocab):
  """A target p and a proposal q with a few zeros each (filtered tokens)."""
  p, q = rng.dirichlet(np.ones(vocab) * 0.7), rng.dirichlet(np.ones(vocab) * 0.7)
  p[rng.choice(vocab, 1)] = 0
  q[rng.choice(vocab, 1)] = 0
  return p / p.sum(), q / q.sum()


CASES = [(k, lookup, seed) for k in (1, 2, 3) for lookup in (None, 0, 2) for seed in (0, 1)]


@pytest.mark.parametrize("k,lookup,seed", CASES)
def test_reference_recursive_rejection_gives_the_target_exactly(k, lookup, seed):
  """The equations themselves: over every ordered draw of k siblings, the output is p."""
  p, q = random_pair(np.random.default_rng(seed), 5)
  total = np.zeros_like(p)
  for draw, prob in ordered_draws(q, k):
    siblings = ([(lookup, False)] if lookup is not None else []) + [(x, True) for x in draw]
    total += prob * reference_output(p, q, siblings)
  np.testing.assert_allclose(total, p, atol=1e-12)


GRID = 2048  # uniforms per probed step: acceptance probabilities to within 1 / GRID


@functools.partial(jax.jit, static_argnames="kernel")
def implementation_output(p_V, q_V, tokens_S, drawn_S, kernel=False):
  """The exact output distribution of `accept.recursive_rejection` (or, `kernel`, of
  `accept.rejection_levels`: the CPU kernels' walk) at a root whose children are tokens_S
  (drawn from q where drawn_S, else point masses), tried in order.

  Step s accepts iff its uniform is below a threshold a_s that depends on nothing random (every
  earlier sibling was rejected): a_s is read off a grid of uniforms with the earlier ones at
  their largest value (rejected unless a_j = 1), and the residual after every rejection from
  the rows that reject all: its log for `recursive_rejection`; for the kernels' walk, the bonus
  tokens drawn there with a grid of random bits (a draw inverts the residual's distribution
  function at u, so GRID evenly spaced u give each token its mass to within 1 / GRID).
  """
  num = tokens_S.shape[0]
  m = num + 1
  tokens = jnp.concatenate([jnp.zeros(1, jnp.int32), tokens_S])
  table = jnp.concatenate([jnp.full(1, -1), jnp.where(drawn_S, 0, -1)]).astype(jnp.int32)
  children = jnp.full((m, num), -1, jnp.int32).at[0].set(jnp.arange(1, m))
  largest = 1 - 2.0**-24
  grid = (jnp.arange(GRID) + 0.5) / GRID
  # Row (s, g): steps before s at `largest`, step s at grid[g], later steps at `largest`; then
  # the rows that reject all.
  step = jnp.arange(num)[:, None, None]
  slot = jnp.arange(num)[None, None, :]
  uniform = jnp.where(slot == step, grid[None, :, None], largest).reshape(-1, num)
  last = GRID if kernel else 1
  uniform = jnp.concatenate([uniform, jnp.full((last, num), largest)])
  rows = uniform.shape[0]
  arrays = (
    jnp.broadcast_to(jnp.log(p_V), (rows, m, p_V.shape[0])),
    jnp.broadcast_to(jnp.log(q_V), (rows, 1, q_V.shape[0])),
    jnp.broadcast_to(tokens, (rows, m)),
    jnp.broadcast_to(table, (rows, m)),
    jnp.broadcast_to(children, (rows, m, num)),
    jnp.broadcast_to(jnp.minimum(jnp.arange(m), 1), (rows, m)),
    uniform[:, None, :],
  )
  cfg = SamplingConfig(temperature=1.0)
  if kernel:
    # u = bits[0] / 2**32 (the low word's bits are below the grid's).
    high = jnp.floor(grid * 2.0**32).astype(jnp.uint32)
    bits = jnp.zeros((rows, 2), jnp.uint32).at[-GRID:, 0].set(high)
    path, bonus = accept.rejection_levels(*arrays, bits, cfg)
    rejected_all = path[-GRID:, 1] == 0
    residual = jnp.zeros_like(p_V).at[bonus[-GRID:]].add(rejected_all / GRID)
  else:
    path, log_residual = accept.recursive_rejection(*arrays, cfg)
    residual = jax.nn.softmax(log_residual[-1])
  accepted_at = path[: num * GRID, 1].reshape(num, GRID)
  threshold = (accepted_at == jnp.arange(1, m)[:, None]).mean(axis=1)  # a_s
  reach = jnp.cumprod(jnp.concatenate([jnp.ones(1), 1 - threshold]))
  out = jnp.zeros_like(p_V).at[tokens_S].add(reach[:-1] * threshold)
  # The all-rejecting rows really rejected all, unless an a_s is 1 (then reach[-1] is 0).
  return out + reach[-1] * residual, path[-1, 1]


@pytest.mark.parametrize("k,lookup,seed", CASES)
@pytest.mark.parametrize("walk", ["xla", "kernel"])
def test_recursive_rejection_matches_the_exhaustive_reference(k, lookup, seed, walk):
  p, q = random_pair(np.random.default_rng(seed), 5)
  total = np.zeros_like(p)
  for draw, prob in ordered_draws(q, k):
    siblings = ([(lookup, False)] if lookup is not None else []) + [(x, True) for x in draw]
    want = reference_output(p, q, siblings)
    tokens = jnp.asarray([x for x, _ in siblings], jnp.int32)
    drawn = jnp.asarray([d for _, d in siblings])
    got, _ = implementation_output(
      jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), tokens, drawn, walk == "kernel"
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=3 / GRID, err_msg=str(siblings))
    total += prob * np.asarray(got, np.float64)
  np.testing.assert_allclose(total, p, atol=3 / GRID)


def test_a_wrong_proposal_is_caught_by_the_exhaustive_check():
  """The check has teeth: trying the second sibling against q itself, not q renormalised over
  the untried siblings, does not give p."""
  p, q = random_pair(np.random.default_rng(3), 5)
  total = np.zeros_like(p)
  for draw, prob in ordered_draws(q, 2):
    total += prob * reference_output(p, q, [(x, True) for x in draw], renormalise=False)
  assert np.abs(total - p).max() > 0.01


# --- sibling draws ----------------------------------------------------------------------------


def test_sibling_draws_are_without_replacement_and_follow_q():
  vocab, k, n = 5, 3, 40000
  q = np.array([0.4, 0.25, 0.2, 0.15, 0.0])
  logq = jnp.log(jnp.asarray(q, jnp.float32))
  index, score = propose_lib.draw_candidates(
    jnp.broadcast_to(logq, (n, vocab)), k, jax.random.key(5)
  )
  index, score = np.asarray(index), np.asarray(score)
  assert all(len(set(row)) == k for row in index)  # no duplicate siblings
  assert not (index == 4).any()  # a token of no q mass is never drawn while others remain
  # The ordered pairs (first, second) against the exact without-replacement probabilities.
  probs = dict(ordered_draws(q, 2))
  cells = sorted(probs)
  observed = np.array([np.sum((index[:, 0] == a) & (index[:, 1] == b)) for a, b in cells])
  expected = np.array([probs[c] for c in cells]) * n
  assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3
  # Rank r's confidence: the largest q among the tokens not drawn before it.
  for r in range(k):
    left = np.log(np.where(q > 0, q, 1e-30))[None, :].repeat(n, 0)
    np.put_along_axis(left, index[:, :r], -np.inf, axis=1)
    np.testing.assert_allclose(score[:, r], left.max(axis=1), rtol=1e-6)
    assert (score[:, r] >= np.log(q[index[:, r]]) - 1e-6).all()


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
def test_drafted_trees_have_distinct_siblings(target, kind):
  pool = tree_specs.parse("sparse16", 4)
  drafter = testing.drafter_for(kind, target)
  batch = 64
  pairs = propose_lib.Pairs(
    tokens=jnp.tile(jnp.asarray([[4, 11, 6]]), (batch, 1)),
    features=jax.random.normal(jax.random.key(0), (batch, 3, 32)),
    count=jnp.full((batch,), 3),
  )
  draw = propose_lib.Draw(SamplingConfig(temperature=1.0), jax.random.key(2))
  _, (tokens, logp, logq) = propose_lib.propose(
    drafter, target, drafter.empty_cache(batch, 16), pairs, None, pool, draw
  )
  tokens = np.asarray(tokens)
  parent = pool.arrays.parent
  for b in range(batch):
    for node in range(pool.num_nodes):
      kids = tokens[b, 1:][parent[1:] == node]
      assert len(set(kids.tolist())) == len(kids), (b, node, kids)
  # Different sequences draw differently (the drafts are samples, not top-k).
  assert len({tuple(row) for row in tokens}) > batch // 2
  rows = propose_lib.draw_tables(kind, pool)
  assert logq.shape[0] == batch and logq.shape[1] > rows.max() and logq.shape[2] == 16
  # Every drafted token has q mass in the row it was drawn from.
  drawn_logq = np.take_along_axis(np.asarray(logq)[:, rows[1:]], tokens[:, 1:, None], -1)
  assert np.isfinite(drawn_logq).all()


# --- whole decodes against the target's exact distribution --------------------------------------

NUM_SAMPLES = 24000
PROMPT = [1, 2, 1, 2, 1]
LENGTH = 4


def oracle_proposer(sampling):
  """A drafter equal to the target: each pool node's children are drawn from the target's own
  (filtered) distribution after the node's path, computed by full forward passes. Drafts as an
  eagle drafter does (one q row per parent node)."""

  def propose(drafter, target, cache, pairs, context, pool, draw=None):
    assert draw is not None
    tokens_BW, num_tokens_B = context
    batch = tokens_BW.shape[0]
    a = pool.arrays
    seq = jnp.pad(tokens_BW, ((0, 0), (0, pool.depth)))
    width = seq.shape[1]
    node_tokens = jnp.zeros((batch, pool.num_nodes), jnp.int32)
    node_logp = jnp.zeros((batch, pool.num_nodes))
    logq = []
    for d in range(pool.depth):
      parents = (a.depth == d).nonzero()[0]
      rows = []
      for node in parents:  # the context, then the node's path below the root
        path = [j for j in range(1, pool.num_nodes) if a.ancestors[node, j]]
        s = seq
        for i, j in enumerate(path):
          s = s.at[jnp.arange(batch), num_tokens_B + i].set(node_tokens[:, j])
        positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
        features, _ = target(s, positions)
        last = jnp.take_along_axis(features, (num_tokens_B + len(path) - 1)[:, None, None], 1)
        rows.append(jax.nn.log_softmax(filtered_logits(target.logits(last), sampling), -1))
      logq.append(jnp.concatenate(rows, axis=1))
      index, score = propose_lib.draw_candidates(
        logq[-1], pool.num_candidates, jax.random.fold_in(draw.key, d)
      )
      children = (a.depth == d + 1).nonzero()[0]
      slot = a.parent[children] - parents[0]
      order = propose_lib.sibling_order(pool)[children]
      node_tokens = node_tokens.at[:, children].set(index[:, slot, order])
      node_logp = node_logp.at[:, children].set(score[:, slot, order])
    return cache, (node_tokens, node_logp, jnp.concatenate(logq, axis=1))

  return propose


T1 = SamplingConfig(temperature=1.0)
T07_TOP_P = SamplingConfig(temperature=0.7, top_p=0.9)
T07_TOP_K = SamplingConfig(temperature=0.7, top_k=4)
T1_TOP_K_P = SamplingConfig(temperature=1.0, top_k=4, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize(
  "kind,tree,sampling,batch",
  [
    ("pspec", "chain", T1, 1),  # a chain: standard speculative sampling
    ("pspec", "sparse8", T07_TOP_K, 4),
    ("eagle", "paths:0/2/0.0/2.1", T07_TOP_P, 1),  # skipped ranks: siblings take draws 0, 1
    ("eagle", "dynamic:6", T1_TOP_K_P, 4),
    ("medusa", "dynamic:5", T07_TOP_P, 4),
    ("medusa", "paths:0/1/0.0+min:0.05+lookup:2", T1, 1000),
    ("pspec", "dynamic:5+lookup:2", T07_TOP_K, 1000),
  ],
)
def test_drafts_from_a_poor_drafter_keep_the_target_distribution(kind, tree, sampling, batch):
  target = testing.make_target(2.0, seed=3, cfg=testing.SAMPLING_TINY)
  cfg = decode.DecodeConfig(max_new_tokens=LENGTH, sampling=sampling, num_draft=3, tree=tree)
  drafter = testing.drafter_for(kind, target, num_draft=3, seed=7)
  assert decode.make_plan(cfg, drafter, 8).drawn
  samples, tau, _ = testing.sample_many(target, drafter, PROMPT, cfg, batch, NUM_SAMPLES)
  assert tau > 1.1  # drafts do get accepted
  probs = testing.exact_joint(target, PROMPT, LENGTH, sampling)
  testing.assert_matches_joint(samples, probs, target.cfg.vocab_size)


# Two candidates whose nodes sit at other indices in their union (0, 1, 2, 0.0, 2.0), so that an
# eagle candidate's rows of q go elsewhere in the union's; the costs make one of them the choice.
ADAPTIVE = "adaptive:paths:0/2/2.0|paths:0/1/0.0+lookup:2"
FAVOUR = {1: ((1, 1), (1, 1), (2, 2)), 2: ((1, 1), (2, 2), (1, 1))}


@pytest.mark.slow
@pytest.mark.parametrize(
  "kind,favoured,sampling,batch",
  [("eagle", 1, T1, 1000), ("pspec", 2, T07_TOP_K, 1000), ("medusa", 1, T07_TOP_P, 1000)],
)
def test_adaptive_rounds_drawn_from_q_keep_the_target_distribution(kind, favoured, sampling, batch):
  target = testing.make_target(2.0, seed=3, cfg=testing.SAMPLING_TINY)
  cfg = decode.DecodeConfig(
    max_new_tokens=LENGTH, sampling=sampling, num_draft=3, tree=ADAPTIVE, costs=FAVOUR[favoured]
  )
  drafter = testing.drafter_for(kind, target, num_draft=3, seed=7)
  assert decode.make_plan(cfg, drafter, 8).drawn
  tokens, lengths = testing.padded([PROMPT], width=8)
  chosen = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter).chosen
  assert chosen[favoured] == chosen.sum() > 0, chosen
  samples, tau, _ = testing.sample_many(target, drafter, PROMPT, cfg, batch, NUM_SAMPLES)
  assert tau > 1.1  # drafts do get accepted
  probs = testing.exact_joint(target, PROMPT, LENGTH, sampling)
  testing.assert_matches_joint(samples, probs, target.cfg.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize(
  "tree,sampling,batch", [("chain", T07_TOP_P, 1), ("sparse8", T1_TOP_K_P, 4)]
)
def test_a_drafter_equal_to_the_target_is_always_accepted(monkeypatch, tree, sampling, batch):
  target = testing.make_target(2.0, seed=3, cfg=testing.SAMPLING_TINY)
  monkeypatch.setitem(propose_lib.PROPOSERS, "eagle", oracle_proposer(sampling))
  cfg = decode.DecodeConfig(max_new_tokens=LENGTH, sampling=sampling, num_draft=3, tree=tree)
  drafter = testing.drafter_for("eagle", target, num_draft=3, seed=7)
  samples, tau, depth1 = testing.sample_many(target, drafter, PROMPT, cfg, batch, NUM_SAMPLES)
  # One round takes every remaining token: the draft is accepted whatever the target samples.
  assert depth1 > 0.995 and tau > LENGTH - 1 - 0.02, (depth1, tau)
  probs = testing.exact_joint(target, PROMPT, LENGTH, sampling)
  testing.assert_matches_joint(samples, probs, target.cfg.vocab_size)


def test_top_k_drafts_stay_selectable_and_greedy_ignores_the_rule(target):
  tokens, lengths = testing.padded([[5, 9, 2, 13, 7], [1, 2]])
  drafter = testing.drafter_for("pspec", target)
  sampling = decode.DecodeConfig(sampling=T1, drafts="top_k", tree="chain")
  drawn = lambda cfg, drafter: decode.make_plan(cfg, drafter, 8).drawn
  assert not drawn(sampling, drafter)
  assert drawn(decode.DecodeConfig(sampling=T1, tree="chain"), drafter)
  assert not drawn(decode.DecodeConfig(sampling=T1, tree="lookup:3"), drafter)
  assert not drawn(decode.DecodeConfig(sampling=T1), testing.drafter_for("pld", target))
  greedy = [decode.DecodeConfig(max_new_tokens=12, drafts=d) for d in decode.DRAFTS]
  outs = [decode.generate(target, tokens, lengths, jax.random.key(0), c, drafter) for c in greedy]
  assert outs[0].tokens.tolist() == outs[1].tokens.tolist()
  with pytest.raises(ValueError, match="drafts must be one of sampled, top_k"):
    decode.DecodeConfig(drafts="q")
