"""Tree specs: the strings that name a token tree (`tree.Tree`), parsed by `parse`.

Presets (`parse`): `chain` (K nodes in a line), `sparseN` (an N-node sparse tree) and
`dynamic:N` (N nodes chosen per round from a 4N-node pool). Sparse trees and pools are grown
best-first under a fixed prior on how often the rank-r candidate is right, the same idea as
Medusa's calibrated trees: `tree.RANK_PRIOR[r]`, one factor per step of the path. A tree can
also be spelled out, `paths:0/0.0/1` (rank paths joined by `/`, ranks by `.`): `tree.best`
builds one from measured acceptance rates (`infer.tune_tree`), and `tree.Tree.spec` writes one.

*Lookup* (`+lookup:L` after any tree, e.g. `paths:0+lookup:4`; `lookup:L` alone, or `lookup`
for L = K, which is how the `pld` drafter decodes by default): in rounds where the context's
last 2 or 3 tokens occurred earlier in it, the tokens that followed them there (prompt lookup)
become a chain of up to L more nodes below the root, tried before the drafter's own; other
rounds verify the drafter's tree alone. Repetition (quoting the prompt, lists, code, the loops
of a small model) is where a drafter guesses worst relative to copying, and a round pays for
the chain only when it has one.

*Gate* (`+min:P` after a drafted tree, before any lookup: `paths:0+min:0.25+lookup:6`): a
drafted node is verified only if its draft confidence is at least P; a round in which no
sequence keeps one verifies without the drafted nodes. On a device where each verified node
costs much (a CPU), rounds whose guesses are unlikely then cost little more than plain decoding.
What the target verifies still decides every token, so decoding stays lossless.

*Adaptive* (`adaptive:A|B|...`, or `adaptive` for `ADAPTIVE`'s default set): a small set of
candidate trees, the root alone always among them (first); each round verifies the one that
promises the most tokens per unit of cost (`pspec_jax.adaptive`). The parsed tree is the
union of the candidates' drafted nodes and their longest lookup chain, with the candidates kept
in `tree.Tree.candidates`.
"""

import dataclasses
import functools
import re

from pspec_jax import tree as tree_lib

__all__ = ["ADAPTIVE", "adaptive", "parse"]

# The candidates of `adaptive` where the drafter names none ({K}: the drafter's K).
ADAPTIVE = "lookup:{K}|paths:0+lookup:{K}|paths:0/0.0+lookup:{K}"


def adaptive(specs: list[str], num_draft: int) -> tree_lib.Tree:
  """The adaptive tree of these candidates (and the root alone, always the first)."""
  candidates = [tree_lib.ROOT_ONLY]
  for spec in specs:
    if spec.startswith("adaptive"):
      raise ValueError(f"an adaptive tree's candidate cannot be adaptive, got {spec!r}")
    tree = parse(spec, num_draft)
    if tree.budget or tree.min_prob:
      raise ValueError(
        f"adaptive candidate {spec!r} must be a static tree without a gate (no dynamic:N, no "
        "+min:P): the choice between candidates replaces both"
      )
    if tree not in candidates:
      candidates.append(tree)
  paths = {p for c in candidates for p in c.paths}
  return tree_lib.Tree(
    paths=tuple(paths),
    lookup=max(c.lookup for c in candidates),
    candidates=tuple(candidates),
  )


def _explicit(spec: str, num_draft: int) -> tree_lib.Tree:
  try:
    body = spec.removeprefix("paths:")
    paths = tuple(tuple(int(r) for r in node.split(".")) for node in body.split("/"))
    tree = tree_lib.Tree(paths=paths)
  except ValueError as e:
    raise ValueError(
      f"bad tree {spec!r}: write rank paths joined by '/', ranks by '.', e.g. paths:0/0.0/1 ({e})"
    ) from None
  if tree.depth > num_draft:
    raise ValueError(f"tree {spec!r} is {tree.depth} deep, deeper than K={num_draft}: raise K")
  return tree


@functools.cache
def parse(spec: str, num_draft: int) -> tree_lib.Tree:
  """A tree from its name: `chain`, `sparseN`, `dynamic:N` (N nodes, root included) or
  `paths:0/0.0/1` (the explicit rank paths), any of them followed by a gate `+min:P`, then by
  `+lookup:L`; or `lookup:L`, the lookup chain alone (no drafted nodes), `lookup` for L = K.

  Drafted trees never go deeper than `num_draft` (K), the draft tokens proposed per round.
  """
  if num_draft < 1:
    raise ValueError(f"num_draft (K) must be >= 1, got {num_draft}")
  if spec == "adaptive" or spec.startswith("adaptive:"):
    specs = spec.removeprefix("adaptive").removeprefix(":").split("|")
    if spec == "adaptive":  # the default set, less what K cannot draft
      specs = [s for s in ADAPTIVE.format(K=num_draft).split("|") if s.count(".") < num_draft]
    return adaptive([s for s in specs if s], num_draft)
  if spec == "lookup":  # no drafted nodes: a lookup chain of K
    return dataclasses.replace(tree_lib.ROOT_ONLY, lookup=num_draft)
  if spec.startswith("lookup:"):  # no drafted nodes: the lookup chain alone
    base, lookup = "", spec.removeprefix("lookup:")
  else:
    base, lookup_sep, lookup = spec.partition("+lookup:")
    if not lookup_sep:
      lookup = None
    elif not base or "lookup" in base:
      raise ValueError(f"unknown tree {spec!r}: write <tree>+lookup:L, or lookup:L alone")
  if lookup is not None:
    if not re.fullmatch(r"[0-9]+", lookup) or int(lookup) < 1:
      raise ValueError(
        f"bad lookup {lookup!r} in tree {spec!r}: write +lookup:L with L >= 1, at the end"
      )
    return dataclasses.replace(
      parse(base, num_draft) if base else tree_lib.ROOT_ONLY, lookup=int(lookup)
    )
  base, gate_sep, min_prob = spec.partition("+min:")
  if gate_sep:
    if not re.fullmatch(r"0?\.[0-9]+", min_prob) or not 0 < float(min_prob) < 1:
      raise ValueError(
        f"bad gate {min_prob!r} in tree {spec!r}: write <tree>+min:P with 0 < P < 1, e.g. "
        "paths:0+min:0.25+lookup:6"
      )
    tree = parse(base, num_draft) if base and "+" not in base else tree_lib.ROOT_ONLY
    if not tree.paths:
      raise ValueError(f"unknown tree {spec!r}: +min:P follows a drafted tree, e.g. paths:0")
    return dataclasses.replace(tree, min_prob=float(min_prob))
  if spec == "chain":
    return tree_lib.chain(num_draft)
  if spec.startswith("paths:"):
    return _explicit(spec, num_draft)
  match = re.fullmatch(r"(sparse|dynamic:)(\d+)", spec)
  if not match or int(match[2]) < 2:
    raise ValueError(
      f"unknown tree {spec!r}: use 'chain', 'sparseN', 'dynamic:N' with N >= 2 nodes, or "
      "'paths:0/0.0/1'"
    )
  n = int(match[2])
  paths = tree_lib.grow(n if match[1] == "sparse" else 4 * n, num_draft)
  if len(paths) + 1 < n:
    raise ValueError(
      f"tree {spec!r} needs more than the {len(paths) + 1} nodes that K={num_draft} allows: "
      "raise K or use fewer nodes"
    )
  return tree_lib.Tree(paths=paths, budget=0 if match[1] == "sparse" else n)
