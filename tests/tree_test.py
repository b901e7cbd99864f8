"""Token trees against slow references written from the definitions in `tree.py`'s docstring."""

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import tree as tree_lib
from pspec_jax import tree_specs
from pspec_jax.tree import RANK_PRIOR, ROOT_ONLY, Tree

# Irregular on purpose: ranks with gaps ((1,) is missing, (0, 3) has no (0, 1)), unequal depths,
# three children below (0, 3), given out of order.
IRREGULAR_PATHS = (
  (0, 3, 5),
  (2,),
  (0, 0, 0, 0),
  (0, 3),
  (2, 1, 0),
  (0,),
  (0, 3, 0),
  (2, 1),
  (0, 0),
  (0, 3, 1),
  (0, 0, 0),
)


def sorted_paths(paths):
  """Parents before children, siblings by rank: (depth, then the path lexicographically)."""
  return sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))


def reference_arrays(paths):
  """depth/parent/rank/ancestors/children of a tree, node by node from the rank paths."""
  nodes = [(), *sorted_paths(paths)]
  m = len(nodes)
  depth = np.array([len(p) for p in nodes])
  parent = np.array([nodes.index(p[:-1]) if p else 0 for p in nodes])
  rank = np.array([p[-1] if p else 0 for p in nodes])
  ancestors = np.array(
    [[nodes[i][: len(nodes[j])] == nodes[j] for j in range(m)] for i in range(m)]
  )
  kids = [
    sorted((j for j in range(1, m) if nodes[j][:-1] == nodes[i]), key=lambda j: nodes[j][-1])
    for i in range(m)
  ]
  children = np.full((m, max(1, *map(len, kids))), -1)
  for i, row in enumerate(kids):
    children[i, : len(row)] = row
  return dict(depth=depth, parent=parent, rank=rank, ancestors=ancestors, children=children)


def assert_arrays_equal(got, want):
  for name, value in want.items():
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), value, err_msg=name)


TREES = {
  "root_only": ROOT_ONLY,
  "chain4": tree_lib.chain(4),
  "sparse16": tree_specs.parse("sparse16", 4),
  "irregular": Tree(paths=IRREGULAR_PATHS),
}


def test_paths_are_sorted_and_normalised():
  tree = Tree(paths=[list(p) for p in IRREGULAR_PATHS])
  assert tree.paths == tuple(sorted_paths(IRREGULAR_PATHS))
  assert all(type(r) is int for p in tree.paths for r in p)
  # Equal trees hash equal whatever the input order: the tree is a static jit argument.
  shuffled = Tree(paths=tuple(reversed(IRREGULAR_PATHS)))
  assert shuffled == tree and hash(shuffled) == hash(tree)
  assert tree.num_nodes == 12 and tree.num_verified == 12
  assert tree.depth == 4 and tree.num_candidates == 6
  pool = Tree(paths=IRREGULAR_PATHS, budget=5)
  assert pool.num_nodes == 12 and pool.num_verified == 5
  assert ROOT_ONLY.num_nodes == 1 and ROOT_ONLY.depth == 0 and ROOT_ONLY.num_candidates == 1


@pytest.mark.parametrize(
  "paths, budget, message",
  [
    (((0,), (1,), (0,)), 0, "distinct"),
    (((0,), (np.int64(0),)), 0, "distinct"),
    (((0,), ()), 0, "non-empty"),
    (((0,), (-1,)), 0, "ranks >= 0"),
    (((0,), (0, -2)), 0, "ranks >= 0"),
    (((0,), (1, 0)), 0, r"no parent \(1,\)"),
    (((0, 0),), 0, r"no parent \(0,\)"),
    (((0,), (1,)), 4, r"budget 4 must be in \[1, 3\]"),
    (((0,), (1,)), -1, "budget -1"),
  ],
)
def test_invalid_trees_raise(paths, budget, message):
  with pytest.raises(ValueError, match=message):
    Tree(paths=paths, budget=budget)


@pytest.mark.parametrize("name", list(TREES))
def test_arrays_match_reference(name):
  tree = TREES[name]
  assert_arrays_equal(tree.arrays, reference_arrays(tree.paths))
  assert tree.arrays.ancestors.dtype == bool
  assert {getattr(tree.arrays, k).dtype for k in ("depth", "parent", "rank", "children")} == {
    np.dtype(np.int32)
  }


@pytest.mark.parametrize("name", list(TREES))
def test_leaf_paths_match_reference(name):
  tree = TREES[name]
  nodes = [(), *sorted_paths(tree.paths)]
  leaves = [i for i, p in enumerate(nodes) if not any(q[:-1] == p for q in nodes[1:])]
  want = np.full((len(leaves), tree.depth + 1), -1)
  for row, leaf in enumerate(leaves):
    chain = [nodes.index(nodes[leaf][:d]) for d in range(len(nodes[leaf]) + 1)]
    want[row, : len(chain)] = chain
  np.testing.assert_array_equal(tree.leaf_paths(), want)


def prior(path):
  return math.prod(RANK_PRIOR[r] for r in path)


@pytest.mark.parametrize(
  "num_nodes, max_depth, max_rank",
  [(16, 4, 8), (64, 5, 8), (25, 3, 3), (9, 1, 8), (2, 3, 8), (1, 3, 8), (13, 3, 2)],
)
def test_grow_keeps_the_highest_prior_paths(num_nodes, max_depth, max_rank):
  paths = tree_lib.grow(num_nodes, max_depth, max_rank)
  everything = [
    p for d in range(1, max_depth + 1) for p in itertools.product(range(max_rank), repeat=d)
  ]
  assert len(everything) >= num_nodes - 1  # the cases above have enough paths to choose from
  assert len(paths) == num_nodes - 1 and len(set(paths)) == len(paths)
  assert all(1 <= len(p) <= max_depth and max(p) < max_rank for p in paths)
  kept = set(paths) | {()}
  assert all(p[:-1] in kept for p in paths)  # prefix-closed
  assert all(p[-1] == 0 or (*p[:-1], p[-1] - 1) in kept for p in paths)  # no rank skipped
  # The best set is unique only up to ties ((0, 1) and (1, 0) have the same prior): compare the
  # sorted priors of the chosen paths with the best num_nodes - 1 priors of all paths.
  best = sorted((prior(p) for p in everything), reverse=True)[: num_nodes - 1]
  got = sorted((prior(p) for p in paths), reverse=True)
  np.testing.assert_allclose(got, best, rtol=1e-12)
  Tree(paths=paths)  # a valid tree


def test_grow_edge_cases():
  assert tree_lib.grow(10, 0) == ()  # depth 0: the root alone
  assert tree_lib.grow(1, 4) == ()
  assert tree_lib.grow(3, 1, max_rank=1) == ((0,),)  # only one path exists
  with pytest.raises(ValueError, match="num_nodes >= 1"):
    tree_lib.grow(0, 3)
  with pytest.raises(ValueError, match="max_depth >= 0"):
    tree_lib.grow(4, -1)


@pytest.mark.parametrize("num_draft", [1, 3, 5])
def test_parse_presets(num_draft):
  chain = tree_specs.parse("chain", num_draft)
  assert chain.paths == tuple((0,) * d for d in range(1, num_draft + 1))
  assert chain.num_verified == num_draft + 1 and chain.budget == 0
  for n in (2, 5, 9):
    sparse = tree_specs.parse(f"sparse{n}", num_draft)
    assert sparse.num_nodes == n and sparse.num_verified == n and sparse.budget == 0
    assert sparse.depth <= num_draft
    assert sparse.paths == tuple(sorted_paths(tree_lib.grow(n, num_draft)))
    dynamic = tree_specs.parse(f"dynamic:{n}", num_draft)
    assert dynamic.budget == n and dynamic.num_verified == n
    # The pool has 4N nodes, or every path there is when fewer exist (8 ranks per level).
    all_paths = sum(8**d for d in range(1, num_draft + 1))
    assert dynamic.num_nodes == min(4 * n, 1 + all_paths) and dynamic.depth <= num_draft
    assert dynamic.paths == tuple(sorted_paths(tree_lib.grow(4 * n, num_draft)))
  assert tree_specs.parse("sparse16", 4).depth == 4


@pytest.mark.parametrize(
  "spec", ["", "tree", "sparse", "sparse1", "sparse0", "dynamic:1", "dynamic4", "dynamic:", "Chain"]
)
def test_parse_rejects_unknown_presets(spec):
  with pytest.raises(ValueError, match="unknown tree"):
    tree_specs.parse(spec, 4)


@pytest.mark.parametrize("paths", [IRREGULAR_PATHS, ((0,),), tree_specs.parse("sparse16", 4).paths])
def test_explicit_spelling_reads_back(paths):
  tree = Tree(paths=paths)
  spec = tree.spec
  assert spec.startswith("paths:") and "," not in spec  # fits a comma-separated list
  assert tree_specs.parse(spec, 4) == tree
  assert tree_specs.parse("paths:0/0.0/1", 2).paths == ((0,), (1,), (0, 0))


@pytest.mark.parametrize(
  "spec, message",
  [
    ("paths:", "bad tree"),
    ("paths:0.0", "no parent"),
    ("paths:0/a", "bad tree"),
    ("paths:0//1", "bad tree"),
    ("paths:0/0", "distinct"),
    ("paths:0/0.0/0.0.0", "deeper than K=2"),
  ],
)
def test_explicit_spelling_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    tree_specs.parse(spec, 2)


def test_a_dynamic_tree_has_no_explicit_spelling():
  with pytest.raises(ValueError, match="dynamic tree"):
    _ = tree_specs.parse("dynamic:4", 4).spec


def reference_best(rates, num_nodes):
  """The largest total rate over every prefix-closed subset of at most num_nodes - 1 paths."""
  paths = sorted(rates, key=lambda p: (len(p), p))
  best = 0.0
  for size in range(num_nodes):
    for subset in itertools.combinations(paths, size):
      if all(p[:-1] in subset or len(p) == 1 for p in subset):
        best = max(best, sum(rates[p] for p in subset))
  return 1.0 + best


@pytest.mark.parametrize("seed", range(4))
def test_best_tree_has_the_most_expected_tokens(seed):
  # Rates as a calibration counts them: the accepted path of each of 50 rounds, drawn at random.
  rng = np.random.default_rng(seed)
  pool = tree_lib.grow(9, 3)
  hits = {p: 0 for p in pool}
  for _ in range(50):
    path = ()
    while True:
      children = [p for p in pool if p[:-1] == path]
      if not children or rng.random() < 0.3:
        break
      path = children[rng.integers(len(children))]
      hits[path] += 1
  rates = {p: h / 50 for p, h in hits.items()}
  for n in range(1, 10):
    tree = tree_lib.best(rates, n)
    assert tree.num_nodes == n and set(tree.paths) <= set(pool)
    assert math.isclose(tree_lib.expected_tokens(tree, rates), reference_best(rates, n))


def test_parse_rejects_bad_num_draft():
  with pytest.raises(ValueError, match="num_draft"):
    tree_specs.parse("chain", 0)


def reference_select(pool, logp_M):
  """Kept pool nodes: the root, then the best budget - 1 by path log-confidence (slow)."""
  nodes = [(), *pool.paths]
  index = {p: i for i, p in enumerate(nodes)}
  confidence = [sum(logp_M[index[p[:d]]] for d in range(1, len(p) + 1)) for p in nodes[1:]]
  order = sorted(range(1, len(nodes)), key=lambda i: -confidence[i - 1])
  return sorted([0, *order[: pool.budget - 1]])


def check_selection(pool, kept_BM, arrays):
  """Each kept set is a tree, and its arrays are those of the tree of the kept rank paths."""
  nodes = [(), *pool.paths]
  width = pool.arrays.children.shape[1]
  for b, kept in enumerate(np.asarray(kept_BM)):
    assert kept[0] == 0 and np.all(np.diff(kept) > 0)
    kept_paths = [nodes[i] for i in kept[1:]]
    assert all(p[:-1] in set(kept_paths) | {()} for p in kept_paths), kept_paths
    want = reference_arrays(kept_paths)
    assert_arrays_equal(Tree(paths=kept_paths).arrays, want)
    # select_dynamic keeps the pool's number of child slots: pad the reference to it.
    children = np.full((len(kept), width), -1)
    children[:, : want["children"].shape[1]] = want["children"]
    row = {name: np.asarray(getattr(arrays, name))[b] for name in want}
    for name, value in (want | {"children": children}).items():
      np.testing.assert_array_equal(row[name], value, err_msg=name)


POOLS = {
  "dynamic:8/K3": tree_specs.parse("dynamic:8", 3),
  "dynamic:6/K4": tree_specs.parse("dynamic:6", 4),
  "irregular/6": Tree(paths=IRREGULAR_PATHS, budget=6),
  "irregular/1": Tree(paths=IRREGULAR_PATHS, budget=1),
  "irregular/12": Tree(paths=IRREGULAR_PATHS, budget=12),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_select_dynamic_keeps_the_most_confident_nodes(name):
  pool = POOLS[name]
  rng = np.random.default_rng(0)
  logp_BM = -rng.exponential(1.0, (3, pool.num_nodes)).astype(np.float32)
  logp_BM[:, 0] = [5.0, np.nan, -np.inf]  # the root's entry is ignored, whatever it is
  kept, arrays = tree_lib.select_dynamic(pool, jnp.asarray(logp_BM))
  assert kept.shape == (3, pool.budget) and kept.dtype == jnp.int32
  want = [reference_select(pool, row) for row in logp_BM]
  np.testing.assert_array_equal(np.asarray(kept), want)
  if 1 < pool.budget < pool.num_nodes:
    assert len({tuple(row) for row in want}) > 1  # the rows differ, so per-row work is tested
  check_selection(pool, kept, arrays)


def test_select_dynamic_drops_impossible_candidates_first():
  pool = tree_specs.parse("dynamic:8", 3)  # 32 nodes, 8 kept
  nodes = [(), *pool.paths]
  rng = np.random.default_rng(1)
  logp_BM = -rng.exponential(1.0, (3, pool.num_nodes)).astype(np.float32)
  # Row 0: three of the nodes that would be kept become impossible (with their subtrees), but
  # plenty of possible nodes are left.
  logp_BM[0, reference_select(pool, logp_BM[0])[1:4]] = -np.inf
  # Row 1: the best depth-1 node is impossible but its subtree is certain; only (1,) is
  # possible below the root, so fewer than `budget` nodes are possible at all.
  logp_BM[1, 1:] = -np.inf
  logp_BM[1, [nodes.index(p) for p in pool.paths if p[0] == 0 and len(p) > 1]] = 0.0
  logp_BM[1, nodes.index((1,))] = -3.0
  # Row 2: every candidate is impossible.
  logp_BM[2, 1:] = -np.inf
  kept, arrays = tree_lib.select_dynamic(pool, jnp.asarray(logp_BM))
  kept = np.asarray(kept)
  index = {p: i for i, p in enumerate(nodes)}
  for b in range(3):
    possible = [
      i
      for i, p in enumerate(nodes)
      if all(np.isfinite(logp_BM[b, index[p[:d]]]) for d in range(1, len(p) + 1))
    ]
    assert (len(possible) >= pool.budget) == (b == 0)
    if b == 0:
      np.testing.assert_array_equal(kept[b], reference_select(pool, logp_BM[b]))
      assert set(kept[b]) <= set(possible)
    else:  # every possible node is kept, and impossible ones only fill the rest
      assert set(possible) <= set(kept[b])
  check_selection(pool, kept, arrays)


def test_parse_rejects_trees_that_k_cannot_hold():
  with pytest.raises(ValueError, match="needs more than the 9 nodes that K=1 allows"):
    tree_specs.parse("sparse16", 1)
  with pytest.raises(ValueError, match="needs more than the 9 nodes that K=1 allows"):
    tree_specs.parse("dynamic:16", 1)
  with pytest.raises(ValueError, match="max_rank"):
    tree_lib.grow(5, 2, max_rank=0)


# --- prompt-lookup chains ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["chain", "sparse8", "paths:0/1/0.0", "dynamic:6"])
def test_lookup_suffix_adds_a_chain_to_any_tree(spec):
  base = tree_specs.parse(spec, 3)
  tree = tree_specs.parse(f"{spec}+lookup:5", 3)
  assert tree.paths == base.paths and tree.budget == base.budget and tree.lookup == 5
  assert tree.num_verified == base.num_verified + 5
  assert tree.depth == base.depth and tree.max_depth == 5  # the drafter still proposes depth
  assert tree_specs.parse(f"{spec}+lookup:1", 3).max_depth == base.depth
  if not tree.budget:
    assert tree_specs.parse(tree.spec, 3) == tree  # the spelling reads back, lookup included


def test_lookup_alone_has_no_drafted_nodes():
  alone = tree_specs.parse("lookup:5", 3)
  assert alone == Tree(paths=(), lookup=5) and alone.num_verified == 6
  assert alone.depth == 0 and alone.max_depth == 5 and alone.spec == "lookup:5"
  assert tree_specs.parse(alone.spec, 3) == alone
  assert tree_specs.parse("lookup", 3) == Tree(paths=(), lookup=3)  # L = K


@pytest.mark.parametrize(
  "spec",
  [
    "chain+lookup:0",
    "chain+lookup:",
    "chain+lookup:x",
    "x+lookup:2",
    "lookup:0",
    "lookup:",
    "+lookup:3",
    "lookup+lookup:2",
    "chain+lookup:\u00b2",
  ],
)
def test_bad_lookup_suffixes_raise(spec):
  with pytest.raises(ValueError, match="lookup|unknown tree"):
    tree_specs.parse(spec, 3)


def reference_with_lookup(tree: Tree, ok):
  """Per-node parent, depth and ordered children of the tree plus the lookup chain, from the
  definition: chain node j hangs below chain node j - 1 (the root for j = 0), exists where
  ok[j], and the chain's first node is tried before the drafter's children of the root."""
  a = tree.arrays
  m, lookup = tree.num_nodes, len(ok)
  parent = list(a.parent) + [0 if j == 0 else m + j - 1 for j in range(lookup)]
  depth = list(a.depth) + [j + 1 for j in range(lookup)]
  children = [[int(c) for c in row if c >= 0] for row in a.children]
  children += [[] for _ in range(lookup)]
  if ok[0]:
    children[0].insert(0, m)
  for j in range(1, lookup):
    if ok[j]:
      children[m + j - 1].append(m + j)
  ancestors = np.zeros((m + lookup,) * 2, bool)
  for i in range(m + lookup):
    node = i
    ancestors[i, node] = True
    while node:
      node = parent[node]
      ancestors[i, node] = True
  return parent, depth, children, ancestors


def test_with_lookup_matches_reference():
  tree = Tree(paths=IRREGULAR_PATHS)
  oks = [[True] * 4, [True, True, False, False], [False] * 4, [True, False, False, False]]
  got = tree_lib.with_lookup(tree_lib.batched(tree, len(oks)), jnp.asarray(oks))
  for row, ok in enumerate(oks):
    parent, depth, children, ancestors = reference_with_lookup(tree, ok)
    assert np.asarray(got.parent[row]).tolist() == parent
    assert np.asarray(got.depth[row]).tolist() == depth
    np.testing.assert_array_equal(got.ancestors[row], ancestors)
    assert [[int(c) for c in r if c >= 0] for r in np.asarray(got.children[row])] == children


# --- gated trees -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["chain", "sparse8", "paths:0/1/0.0", "dynamic:6"])
def test_min_suffix_gates_any_drafted_tree(spec):
  base = tree_specs.parse(spec, 3)
  tree = tree_specs.parse(f"{spec}+min:0.25+lookup:4", 3)
  assert tree.paths == base.paths and tree.budget == base.budget
  assert tree.min_prob == 0.25 and tree.lookup == 4
  assert tree.num_verified == base.num_verified + 4  # the gate adds no nodes
  if not base.budget:
    assert tree.spec == f"{base.spec}+min:0.25+lookup:4"
    assert tree_specs.parse(tree.spec, 3) == tree  # the spelling reads back, gate included
  assert tree_specs.parse(f"{spec}+min:.05", 3).min_prob == 0.05


@pytest.mark.parametrize(
  "spec",
  [
    "chain+min:0",
    "chain+min:1",
    "chain+min:1.5",
    "chain+min:",
    "chain+min:x",
    "chain+min:-0.2",
    "chain+min:0.2+min:0.3",
    "chain+lookup:3+min:0.2",  # the gate comes before the lookup
    "+min:0.2",
    "lookup+min:0.2",
    "lookup:3+min:0.2",
    "x+min:0.2",
  ],
)
def test_bad_gates_raise(spec):
  with pytest.raises(ValueError, match="gate|lookup|unknown tree"):
    tree_specs.parse(spec, 3)


def test_gated_cuts_the_nodes_below_the_confidence_reference():
  tree = Tree(paths=IRREGULAR_PATHS)
  rng = np.random.default_rng(0)
  logp = np.log(rng.uniform(0.05, 1.0, (3, tree.num_nodes)))
  got = tree_lib.gated(tree_lib.batched(tree, 3), jnp.asarray(logp), 0.2)
  nodes = [(), *tree.paths]
  full = reference_arrays(tree.paths)["children"]
  kept = []
  for row in range(3):
    # A node stays iff the product of the draft probabilities along its path is >= 0.2.
    confidence = np.array(
      [
        math.prod(math.exp(logp[row, nodes.index(p[:d])]) for d in range(1, len(p) + 1))
        for p in nodes
      ]
    )
    want = np.where((full >= 0) & (confidence[full] >= 0.2), full, -1)
    np.testing.assert_array_equal(got.children[row], want)
    kept.append((want >= 0).sum())
  assert min(kept) > 0 and max(kept) < (full >= 0).sum()  # some nodes stay, some go
  np.testing.assert_array_equal(got.ancestors, tree_lib.batched(tree, 3).ancestors)
