"""Tree acceptance: greedy against a slow walk, sampling against the target's distribution."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from pspec_jax import tree as tree_lib
from pspec_jax import tree_specs
from pspec_jax.accept import accept
from pspec_jax.sampling import SamplingConfig, filtered_logits
from pspec_jax.tree import Tree

GREEDY = SamplingConfig()
KEY = jax.random.key(0)  # unused when greedy
P_VALUE = 1e-3

accept_jit = jax.jit(accept, static_argnames=("max_depth", "cfg"))


def reference_greedy(logits_MV, tokens_M, paths, max_depth):
  """Walks down from the root, taking the first child (in rank order) holding the argmax."""
  nodes = [(), *sorted(paths, key=lambda p: (len(p), p))]
  path = [0]
  while True:
    here = nodes[path[-1]]
    want = int(np.argmax(logits_MV[path[-1]]))
    kids = sorted((j for j, p in enumerate(nodes) if p and p[:-1] == here), key=lambda j: nodes[j])
    hit = [j for j in kids if tokens_M[j] == want]
    if not hit:
      break
    path.append(hit[0])
  num_accepted = len(path) - 1
  path += [path[-1]] * (max_depth + 1 - len(path))
  return path, num_accepted, int(np.argmax(logits_MV[path[-1]]))


def greedy_case(rng, batch, num_nodes, parent_BM, vocab=16):
  """Random logits and tokens; most children hold their parent's argmax so paths get long."""
  logits = rng.normal(size=(batch, num_nodes, vocab)).astype(np.float32)
  tokens = rng.integers(0, vocab, (batch, num_nodes)).astype(np.int32)
  for b in range(batch):
    for j in range(1, num_nodes):
      if rng.random() < 0.6:
        tokens[b, j] = np.argmax(logits[b, parent_BM[b, j]])
  return logits, tokens


@pytest.mark.parametrize(
  "tree",
  [
    tree_lib.chain(4),
    tree_specs.parse("sparse16", 4),
    Tree(paths=((0,), (2,), (3,), (0, 0), (0, 3), (0, 3, 1), (0, 3, 0), (3, 0), (3, 0, 0))),
  ],
)
def test_greedy_matches_reference_walk(tree):
  batch = 16
  rng = np.random.default_rng(tree.num_nodes)
  arrays = tree_lib.batched(tree, batch)
  logits, tokens = greedy_case(rng, batch, tree.num_nodes, np.asarray(arrays.parent))
  got = accept_jit(jnp.asarray(logits), jnp.asarray(tokens), arrays, tree.depth, KEY, GREEDY)
  path, num_accepted, bonus = map(np.asarray, got)
  assert path.shape == (batch, tree.depth + 1)
  want = [reference_greedy(logits[b], tokens[b], tree.paths, tree.depth) for b in range(batch)]
  np.testing.assert_array_equal(path, [w[0] for w in want])
  np.testing.assert_array_equal(num_accepted, [w[1] for w in want])
  np.testing.assert_array_equal(bonus, [w[2] for w in want])
  assert len(set(num_accepted)) >= 3 and num_accepted.max() >= 2  # the walks differ


def test_greedy_on_dynamic_trees_that_differ_per_row():
  pool = tree_specs.parse("dynamic:8", 3)
  batch = 16
  rng = np.random.default_rng(7)
  logp = -rng.exponential(1.0, (batch, pool.num_nodes)).astype(np.float32)
  kept, arrays = tree_lib.select_dynamic(pool, jnp.asarray(logp))
  kept = np.asarray(kept)
  logits, tokens = greedy_case(rng, batch, pool.budget, np.asarray(arrays.parent))
  got = accept_jit(jnp.asarray(logits), jnp.asarray(tokens), arrays, pool.depth, KEY, GREEDY)
  path, num_accepted, bonus = map(np.asarray, got)
  for b in range(batch):
    kept_paths = [pool.paths[i - 1] for i in kept[b, 1:]]
    want = reference_greedy(logits[b], tokens[b], kept_paths, pool.depth)
    np.testing.assert_array_equal(path[b], want[0])
    assert (num_accepted[b], bonus[b]) == want[1:]
  assert len({tuple(row) for row in kept}) > 1 and len(set(num_accepted)) >= 3


def test_root_only_tree():
  batch = 4
  logits = jax.random.normal(jax.random.key(0), (batch, 1, 10))
  arrays = tree_lib.batched(tree_lib.ROOT_ONLY, batch)
  tokens = jnp.zeros((batch, 1), jnp.int32)
  path, num_accepted, bonus = accept_jit(logits, tokens, arrays, 0, jax.random.key(1), GREEDY)
  np.testing.assert_array_equal(path, np.zeros((batch, 1)))
  np.testing.assert_array_equal(num_accepted, np.zeros(batch))
  np.testing.assert_array_equal(bonus, np.argmax(logits[:, 0], axis=-1))


# The sampling tree: the root (node 0) has children 1, 2, 3; node 1 has children 4, 5. Nodes 1
# and 2 propose the same token, so node 2 can never be accepted (its token's mass is gone once
# node 1 is rejected).
SMALL_TREE = Tree(paths=((0,), (1,), (2,), (0, 0), (0, 1)))
VOCAB = 6
LOGITS_MV = np.array(
  [
    [0.3, -0.5, 1.0, 0.2, 0.6, -1.2],  # root
    [0.9, 0.4, -0.8, 0.5, 0.0, -0.3],  # node 1
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # node 2 (never reached)
    [-0.4, 1.1, 0.2, 0.3, -0.9, 0.6],  # node 3
    [0.1, -0.2, 0.7, -1.0, 0.8, 0.3],  # node 4
    [0.5, 0.5, -0.5, 0.0, 1.2, -0.7],  # node 5
  ],
  np.float32,
)
NODE_TOKENS = np.array([0, 2, 2, 0, 3, 5], np.int32)
NUM_DRAWS = 20000


@functools.partial(jax.jit, static_argnames=("cfg", "num_draws"))
def many_draws(logits_MV, tokens_M, key, cfg, num_draws):
  arrays = tree_lib.batched(SMALL_TREE, 1)

  def one(k):
    path, num_accepted, bonus = accept(
      logits_MV[None], tokens_M[None], arrays, SMALL_TREE.depth, k, cfg
    )
    return path[0], num_accepted[0], bonus[0]

  # One key per draw from its own seed: keys split from one key (`split(key, n)`, each then
  # split again by the walk) made this walk's chi-square statistics overdispersed, p-values of
  # 1e-6 to 1e-4 at some seeds with Gumbel-max and inverse-CDF draws alike; from seeds they
  # follow the chi-square law.
  seeds = jax.random.randint(key, (num_draws,), 0, jnp.iinfo(jnp.int32).max)
  return jax.vmap(one)(jax.vmap(jax.random.key)(seeds))


def emitted(path, num_accepted, bonus, tokens):
  """The tokens of each draw, the accepted drafts then the bonus, -1 padded: [N, P + 1]."""
  depth = path.shape[1] - 1
  out = np.full((len(path), depth + 1), -1)
  for d in range(1, depth + 1):
    out[:, d - 1] = np.where(num_accepted >= d, tokens[path[:, d]], out[:, d - 1])
  out[np.arange(len(path)), num_accepted] = bonus
  return out


def assert_follows(samples, probs, what):
  """Chi-square goodness of fit; tokens of zero probability must never appear."""
  counts = np.bincount(samples, minlength=len(probs))
  assert counts[probs == 0].sum() == 0, (what, counts, probs)
  support = probs > 0
  expected = probs[support] / probs[support].sum() * counts.sum()
  assert expected.min() >= 5, (what, expected)  # enough draws for the chi-square test
  p_value = scipy.stats.chisquare(counts[support], expected).pvalue
  assert p_value > P_VALUE, (what, p_value, counts, expected)


CONFIGS = {
  "T=1": SamplingConfig(temperature=1.0),
  "T=0.7,top_k=4,top_p=0.8": SamplingConfig(temperature=0.7, top_k=4, top_p=0.8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampling_is_lossless(name):
  cfg = CONFIGS[name]
  target = np.asarray(jax.nn.softmax(filtered_logits(jnp.asarray(LOGITS_MV), cfg), axis=-1))
  target = target.astype(np.float64)
  if cfg.top_k:  # the filters bite: node 5's token has no target mass below node 1
    assert (target == 0).sum(axis=-1)[[0, 1, 3, 4, 5]].min() >= 2
    assert target[1, NODE_TOKENS[5]] == 0
  path, num_accepted, bonus = map(
    np.asarray,
    many_draws(
      jnp.asarray(LOGITS_MV), jnp.asarray(NODE_TOKENS), jax.random.key(42), cfg, NUM_DRAWS
    ),
  )
  tokens = emitted(path, num_accepted, bonus, NODE_TOKENS)
  # Both depths are reached often, so the walk (not just the bonus) is what the test sees.
  assert (num_accepted == 2).sum() > 1000 and (num_accepted == 0).sum() > 1000
  assert_follows(tokens[:, 0], target[0], "first token")
  # Node 1 emits token 2 first, and nothing else does: rejecting it removes 2 from the residual.
  np.testing.assert_array_equal(path[:, 1] == 1, tokens[:, 0] == NODE_TOKENS[1])
  a = SMALL_TREE.arrays
  for node in range(1, SMALL_TREE.num_nodes):
    depth = a.depth[node]
    reached = path[:, depth] == node
    chain = [node, a.parent[node]] if depth == 2 else [node]
    if node == 2 or any(target[a.parent[n], NODE_TOKENS[n]] == 0 for n in chain):
      # Node 2 repeats node 1's token; a token without target mass is never accepted.
      assert not reached.any(), node
    else:  # the token after node's: the next accepted draft or the bonus there
      assert_follows(tokens[reached, depth], target[node], f"token after node {node}")


def test_root_only_sampling_follows_the_target():
  cfg = SamplingConfig(temperature=1.3, top_k=5)
  logits = jnp.asarray(LOGITS_MV[:1])
  arrays = tree_lib.batched(tree_lib.ROOT_ONLY, NUM_DRAWS)
  path, num_accepted, bonus = accept_jit(
    jnp.broadcast_to(logits, (NUM_DRAWS, 1, VOCAB)),
    jnp.zeros((NUM_DRAWS, 1), jnp.int32),
    arrays,
    0,
    jax.random.key(3),
    cfg,
  )
  assert not np.asarray(path).any() and not np.asarray(num_accepted).any()
  target = np.asarray(jax.nn.softmax(filtered_logits(logits, cfg), axis=-1))[0]
  assert (target == 0).sum() == 1
  assert_follows(np.asarray(bonus), target.astype(np.float64), "root-only bonus")


def test_sampling_stays_in_the_support_when_rounding_rejects_every_child(monkeypatch):
  # top-k 2: tokens 2 and 3 hold all the mass. With the largest uniform, 1 - p(2) computed in
  # float32 can exceed p(3), so rounding may reject a child that exact arithmetic accepts, and
  # nothing is left to draw the bonus from; the emitted token must still be 2 or 3.
  cfg = SamplingConfig(temperature=1.0, top_k=2)
  rng = np.random.default_rng(0)
  largest = jnp.float32(1 - 2**-23)
  for _ in range(20000):
    row = np.array([-5.0, -6.0, rng.normal() * 3, rng.normal() * 3], np.float32)
    kept = filtered_logits(jnp.asarray(row)[None], cfg)[0]
    p = np.asarray(jnp.exp(kept - jax.nn.logsumexp(kept)))
    if largest * (1 - p[2]) >= p[3]:
      break
  else:
    pytest.skip("no float32 corner case found")
  tokens = [0, 2, 3, 0]  # root children: tokens 2, 3 and 0 (which has no mass)
  arrays = tree_lib.batched(Tree(paths=((0,), (1,), (2,))), 1)
  logits = jnp.zeros((1, 4, 4)).at[0, 0].set(row)
  monkeypatch.setattr(jax.random, "uniform", lambda key, shape, *a, **k: jnp.full(shape, largest))
  path, num_accepted, bonus = accept(logits, jnp.asarray([tokens]), arrays, 1, KEY, cfg)
  emitted = tokens[int(path[0, 1])] if int(num_accepted[0]) else int(bonus[0])
  assert emitted in (2, 3)
