"""Token trees for one verification pass (docs/design.md section 3.3).

A tree is a set of *rank paths*, Medusa style: `(0,)` is the drafter's most probable token at
depth 1, `(1,)` its second, `(0, 2)` the third candidate at depth 2 below the first one, and so
on. The root (node 0, the empty path) is the bonus token x_{n+1}; a node at depth d is a
candidate for x_{n+1+d}. Nodes are stored sorted by (depth, path), so parents precede children
and siblings appear in rank order, which acceptance relies on.

Static trees are the same every round. A dynamic tree (EAGLE-2 style) keeps, each round, the
`budget` nodes of a larger static *pool* with the highest draft confidence (the product of the
draft probabilities along the node's path); because confidence never grows along a path, the
kept set is a tree.

Trees are spelled as strings (`tree_specs.parse`: presets, explicit rank paths, lookup chains,
gates and adaptive sets); a `Tree` writes its own spelling (`Tree.spec`).
"""

import dataclasses
import functools
import heapq
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = [
  "RANK_PRIOR",
  "ROOT_ONLY",
  "Path",
  "Tree",
  "TreeArrays",
  "batched",
  "best",
  "chain",
  "expected_tokens",
  "gated",
  "grow",
  "log_confidence",
  "max_children",
  "select_dynamic",
  "with_lookup",
]

# Prior probability that the rank-r draft candidate is the accepted one (sums to < 1).
RANK_PRIOR = (0.6, 0.15, 0.07, 0.04, 0.025, 0.015, 0.01, 0.007)
Path = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static tree of rank paths (hashable: a static jit argument).

  Attributes:
    paths: rank paths of the non-root nodes, sorted by (depth, path), prefix-closed.
    budget: 0 for a static tree; else the nodes (root included) kept per round from this pool.
    lookup: L, the most prompt-lookup nodes a round adds below the root (0: none).
    min_prob: drafted nodes of lower draft confidence are not verified (0: all are).
    candidates: an adaptive tree's candidate trees (static, ungated), the root alone first;
      `paths` and `lookup` are then their union. Empty for any other tree.
  """

  paths: tuple[Path, ...]
  budget: int = 0
  lookup: int = 0
  min_prob: float = 0.0
  candidates: tuple["Tree", ...] = ()

  def __post_init__(self):
    paths = tuple(tuple(int(r) for r in p) for p in self.paths)
    if len(set(paths)) != len(paths) or any(not p or min(p) < 0 for p in paths):
      raise ValueError(
        f"tree paths must be distinct, non-empty tuples of ranks >= 0, got {self.paths}"
      )
    known = set(paths) | {()}
    for p in paths:
      if p[:-1] not in known:
        raise ValueError(f"tree path {p} has no parent {p[:-1]} in the tree")
    object.__setattr__(self, "paths", tuple(sorted(paths, key=lambda p: (len(p), p))))
    if self.budget and not 1 <= self.budget <= self.num_nodes:
      raise ValueError(f"dynamic tree budget {self.budget} must be in [1, {self.num_nodes}]")
    if self.lookup < 0:
      raise ValueError(f"lookup nodes must be >= 0, got {self.lookup}")
    if not 0 <= self.min_prob < 1:
      raise ValueError(f"min draft confidence must be in [0, 1), got {self.min_prob}")

  @property
  def num_nodes(self) -> int:
    """Nodes of the (pool) tree, root included."""
    return len(self.paths) + 1

  @property
  def num_verified(self) -> int:
    """The most nodes the target verifies in a round, root and lookup included (M)."""
    return (self.budget or self.num_nodes) + self.lookup

  @property
  def depth(self) -> int:
    """The drafted tree's deepest level: draft tokens the drafter proposes per round."""
    return max((len(p) for p in self.paths), default=0)

  @property
  def max_depth(self) -> int:
    """The longest path a round can accept (P), lookup included."""
    return max(self.depth, self.lookup)

  @property
  def drafted(self) -> "Tree":
    """This tree without its lookup chain: what a round verifies where no chain is found."""
    return dataclasses.replace(self, lookup=0)

  @property
  def num_candidates(self) -> int:
    """Candidates per depth the drafter must rank (1 + the largest rank used)."""
    return 1 + max((r for p in self.paths for r in p), default=0)

  @property
  def spec(self) -> str:
    """The explicit spelling `tree_specs.parse` reads back: `paths:0/0.0/1`."""
    if self.budget:
      raise ValueError("a dynamic tree has no explicit spelling; use its preset name")
    if self.candidates:
      return "adaptive:" + "|".join(c.spec for c in self.candidates[1:])
    lookup = f"+lookup:{self.lookup}" if self.lookup else ""
    if not self.paths:
      return lookup.removeprefix("+") if lookup else "paths:"
    gate = f"+min:{self.min_prob!r}" if self.min_prob else ""
    return "paths:" + "/".join(".".join(map(str, p)) for p in self.paths) + gate + lookup

  @functools.cached_property
  def arrays(self) -> "TreeArrays":
    """The static tree as numpy arrays (no batch axis)."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(self.paths)}
    all_paths = [(), *self.paths]
    m = len(all_paths)
    depth = np.array([len(p) for p in all_paths], np.int32)
    parent = np.array([index[p[:-1]] if p else 0 for p in all_paths], np.int32)
    rank = np.array([p[-1] if p else 0 for p in all_paths], np.int32)
    ancestors = np.zeros((m, m), bool)
    for i, p in enumerate(all_paths):
      for d in range(len(p) + 1):
        ancestors[i, index[p[:d]]] = True
    return TreeArrays(
      depth=depth,
      parent=parent,
      rank=rank,
      ancestors=ancestors,
      children=_children(parent, max_children(parent)),
    )

  def leaf_paths(self) -> np.ndarray:
    """Retrieval indices [R, P + 1]: node indices from the root to each leaf, -1 padded."""
    a = self.arrays
    leaves = [i for i in range(self.num_nodes) if not (a.parent[1:] == i).any()]
    out = np.full((len(leaves), self.depth + 1), -1, np.int32)
    for row, leaf in enumerate(leaves):
      chain = [leaf]
      while chain[-1]:
        chain.append(int(a.parent[chain[-1]]))
      out[row, : len(chain)] = chain[::-1]
    return out


@struct.dataclass
class TreeArrays:
  """One tree as arrays; with a leading batch axis inside the decode loop.

  depth [M], parent [M] (the root is its own parent), rank [M], ancestors [M, M] (node i sees
  node j iff j is i or one of its ancestors) and children [M, C] (node indices in rank order,
  -1 padded).
  """

  depth: jax.Array
  parent: jax.Array
  rank: jax.Array
  ancestors: jax.Array
  children: jax.Array


def max_children(parent) -> int:
  counts = np.bincount(np.asarray(parent)[1:], minlength=1)
  return max(int(counts.max()), 1)


def _children(parent, num_slots):
  """children[M, C] from parent[M] (numpy or jax), in node order."""
  xp = jnp if isinstance(parent, jax.Array) else np
  m = parent.shape[-1]
  nodes = xp.arange(m)
  is_child = (parent[None, :] == nodes[:, None]) & (nodes[None, :] > 0)  # [parent, node]
  slot = xp.cumsum(is_child, axis=1) - 1  # sibling order of each child
  table = xp.where(
    is_child[:, None, :] & (slot[:, None, :] == xp.arange(num_slots)[None, :, None]),
    nodes[None, None, :],
    -1,
  )
  return table.max(axis=-1).astype(xp.int32)


def grow(num_nodes: int, max_depth: int, max_rank: int = len(RANK_PRIOR)) -> tuple[Path, ...]:
  """The `num_nodes`-node tree (root included) of highest prior, grown best-first."""
  if num_nodes < 1 or max_depth < 0 or not 1 <= max_rank <= len(RANK_PRIOR):
    raise ValueError(
      f"need num_nodes >= 1, max_depth >= 0 and 1 <= max_rank <= {len(RANK_PRIOR)}, got "
      f"{num_nodes}, {max_depth}, {max_rank}"
    )
  log_prior = [math.log(p) for p in RANK_PRIOR[:max_rank]]
  paths: list[Path] = []
  heap = [(-log_prior[0], (0,))] if max_depth and num_nodes > 1 else []
  while heap and len(paths) < num_nodes - 1:
    neg_score, path = heapq.heappop(heap)
    paths.append(path)
    # The next candidates: this node's first child and its next sibling.
    if len(path) < max_depth:
      heapq.heappush(heap, (neg_score - log_prior[0], (*path, 0)))
    if path[-1] + 1 < len(log_prior):
      step = log_prior[path[-1] + 1] - log_prior[path[-1]]
      heapq.heappush(heap, (neg_score - step, (*path[:-1], path[-1] + 1)))
  return tuple(paths)


def best(rates: Mapping[Path, float], num_nodes: int) -> Tree:
  """The tree of at most `num_nodes` nodes (root included) that accepts the most tokens.

  Args:
    rates: how often each rank path's node is accepted per round, for the paths measured (a
      child is never accepted more often than its parent).
    num_nodes: the node budget, root included.

  Returns:
    The prefix-closed subset of `rates` with the largest sum of rates, i.e. the largest expected
    tokens per round (1 + the sum). Grown greedily from the root: with rates that never grow
    along a path, the best frontier node is always part of an optimal tree. Ties go to the
    shallower node, then the lower ranks.
  """
  if num_nodes < 1:
    raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
  children: dict[Path, list[Path]] = {}
  for p in rates:
    children.setdefault(p[:-1], []).append(p)
  frontier = [(-rates[p], len(p), p) for p in children.get((), [])]
  heapq.heapify(frontier)
  paths: list[Path] = []
  while frontier and len(paths) < num_nodes - 1:
    _, _, path = heapq.heappop(frontier)
    paths.append(path)
    for q in children.get(path, []):
      heapq.heappush(frontier, (-rates[q], len(q), q))
  return Tree(paths=tuple(paths))


def expected_tokens(tree: Tree, rates: Mapping[Path, float]) -> float:
  """Expected tokens per round of a static tree: the bonus plus each node's acceptance rate."""
  return 1.0 + sum(rates.get(p, 0.0) for p in tree.paths)


def chain(num_draft: int) -> Tree:
  return Tree(paths=tuple((0,) * d for d in range(1, num_draft + 1)))


ROOT_ONLY = Tree(paths=())


def batched(tree: Tree, batch: int) -> TreeArrays:
  """The static tree's arrays broadcast over the batch."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *x.shape)), tree.arrays)


def with_lookup(tree: TreeArrays, ok_BL: jax.Array) -> TreeArrays:
  """The batched tree of M nodes with a chain of L lookup nodes (M .. M+L-1) below its root.

  The chain's first node is the root's first child, so it is tried before the drafter's; node j
  of the chain exists where `ok_BL[:, j]` (a lookup found that many tokens), else it and the
  rest of the chain are cut (no parent links to them).
  """
  batch, m = tree.depth.shape
  lookup = ok_BL.shape[1]
  chain = m + jnp.arange(lookup)
  full = jnp.arange(m + lookup)
  # Chain node j sees the root and the chain nodes up to j.
  sees = (full[None, :] == 0) | ((full[None, :] >= m) & (full[None, :] <= chain[:, None]))
  ancestors = jnp.concatenate(
    [
      jnp.pad(tree.ancestors, ((0, 0), (0, 0), (0, lookup))),
      jnp.broadcast_to(sees, (batch, lookup, m + lookup)),
    ],
    axis=1,
  )
  # Children: the root's first slot is the chain's first node; chain node j's is node j + 1.
  next_in_chain = jnp.where(ok_BL, chain, -1)  # [B, L]: the chain node at j, if found
  first = jnp.full((batch, m + lookup, 1), -1, jnp.int32).at[:, 0, 0].set(next_in_chain[:, 0])
  first = first.at[:, m:-1, 0].set(next_in_chain[:, 1:])
  rest = jnp.pad(tree.children, ((0, 0), (0, lookup), (0, 0)), constant_values=-1)
  return TreeArrays(
    depth=jnp.concatenate(
      [tree.depth, jnp.broadcast_to(1 + jnp.arange(lookup), (batch, lookup))], 1
    ),
    parent=jnp.concatenate(
      [
        tree.parent,
        jnp.broadcast_to(jnp.concatenate([jnp.zeros(1, jnp.int32), chain[:-1]]), (batch, lookup)),
      ],
      1,
    ).astype(jnp.int32),
    rank=jnp.pad(tree.rank, ((0, 0), (0, lookup))),
    ancestors=ancestors,
    children=jnp.concatenate([first, rest], axis=2).astype(jnp.int32),
  )


def log_confidence(ancestors_BMM: jax.Array, node_logp_BM: jax.Array) -> jax.Array:
  """[B, M] log draft confidence of every node: the draft log-probabilities along its path
  summed (the root's entry is ignored; the root's confidence is 0)."""
  # Impossible candidates (-inf) become very unlikely ones so that the sums stay finite.
  logp = jnp.maximum(node_logp_BM.astype(jnp.float32), -1e4).at[:, 0].set(0.0)
  # A masked sum, not a matmul: exact, whatever the matmul precision.
  return jnp.where(ancestors_BMM, logp[:, None, :], 0.0).sum(-1)


def gated(tree: TreeArrays, node_logp_BM: jax.Array, min_prob: float) -> TreeArrays:
  """The batched tree without its nodes of draft confidence below `min_prob`: no parent links
  to them (their descendants, never more confident, go with them)."""
  keep_BM = log_confidence(tree.ancestors, node_logp_BM) >= math.log(min_prob)
  kids = tree.children
  batch = kids.shape[0]
  kept_kid = jnp.take_along_axis(keep_BM, jnp.maximum(kids, 0).reshape(batch, -1), axis=1)
  return tree.replace(children=jnp.where((kids >= 0) & kept_kid.reshape(kids.shape), kids, -1))


def select_dynamic(pool: Tree, node_logp_BM: jax.Array) -> tuple[jax.Array, TreeArrays]:
  """Keeps the `pool.budget` most confident nodes of the pool, per sequence.

  Args:
    pool: the dynamic tree's pool.
    node_logp_BM: draft log-probability of every pool node's token given its parent (the
      root's entry is ignored).

  Returns:
    (kept_BM, arrays): kept pool-node indices in pool order (root first) and the kept tree.
  """
  a = pool.arrays
  # top_k prefers the lower index on ties, and parents have lower indices than their children.
  confidence = log_confidence(jnp.asarray(a.ancestors)[None], node_logp_BM)
  confidence = confidence.at[:, 0].set(jnp.inf)
  kept = jnp.sort(jax.lax.top_k(confidence, pool.budget)[1], axis=-1).astype(jnp.int32)

  def one(kept_M):
    parent = jnp.searchsorted(kept_M, jnp.asarray(a.parent)[kept_M]).astype(jnp.int32)
    return TreeArrays(
      depth=jnp.asarray(a.depth)[kept_M],
      parent=parent,
      rank=jnp.asarray(a.rank)[kept_M],
      ancestors=jnp.asarray(a.ancestors)[kept_M][:, kept_M],
      children=_children(parent, a.children.shape[1]),
    )

  return kept, jax.vmap(one)(kept)
