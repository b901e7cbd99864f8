"""What a decode does, resolved once: `DecodeConfig` (the user's settings) and `Plan`.

`make_plan` resolves a `DecodeConfig` against the drafter's config and the prompt width, at the
boundary (`decode.generate`, `decode.stream`, the programs): the tree drafted each round, its
depth, whether drafts are drawn from the drafter's distribution and the cache length. The round
functions (`pspec_jax.rounds`) take the frozen, hashable
`Plan` as their first, static argument and never re-resolve a tree string.
"""

import dataclasses

from jax.sharding import Mesh

from pspec_jax import adaptive, tree_specs
from pspec_jax import tree as tree_lib
from pspec_jax.drafter import Drafter
from pspec_jax.sampling import SamplingConfig

__all__ = ["DRAFTS", "DecodeConfig", "Plan", "make_plan", "resolve_tree"]

DRAFTS = ("sampled", "top_k")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """Static decoding settings (hashable: a change recompiles).

  Attributes:
    max_new_tokens: generation budget per sequence, EOS included.
    sampling: greedy (default) or temperature / top-k / top-p sampling.
    eos_ids: token ids that end a sequence (it is kept in the output).
    max_len: cache slots per sequence; 0 means prompt width + max_new_tokens + the longest
      path a round can accept (`Tree.max_depth`).
    pad_id: fills `DecodeOutput.tokens` past each sequence's length.
    num_draft: K, draft tokens per round; 0 means the drafter's own.
    tree: tree name (`tree.parse`: chain, sparseN, dynamic:N, paths:..., each optionally with
      a gate +min:P and +lookup:L; or adaptive, adaptive:A|B|...); `fixed` is the drafter's
      fixed tree for this temperature, "" its default (`DrafterConfig.tree_for`).
    costs: an adaptive tree's cost of a round with each candidate, the root alone first (1.0),
      relative to a round with the root alone: (lookup chain left out, lookup chain verified)
      pairs, as `infer.calibration` measures them; () is `adaptive.default_costs`' guess.
    mesh: shard the batch and the caches over this mesh (parameters: `decode.shard`); None is
      one device.
    drafts: how a drafter with a distribution (pspec, eagle, medusa) drafts when sampling
      (T > 0): "sampled" draws each node's children from its filtered distribution q without
      replacement and accepts by speculative sampling (a draft is then accepted with
      probability 1 - TV(p, q)); "top_k" takes its most probable tokens and accepts them by the
      multi-child rule (a draft x with probability p(x)). Greedy decoding, pld and prompt-lookup
      nodes are deterministic either way.
  """

  max_new_tokens: int = 128
  sampling: SamplingConfig = SamplingConfig()
  eos_ids: tuple[int, ...] = ()
  max_len: int = 0
  pad_id: int = 0
  num_draft: int = 0
  tree: str = ""
  costs: tuple[tuple[float, float], ...] = ()
  mesh: Mesh | None = None
  drafts: str = "sampled"

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.max_len < 0:
      raise ValueError(f"max_len must be >= 0 (0: derived), got {self.max_len}")
    if self.num_draft < 0:
      raise ValueError(f"num_draft must be >= 0 (0: the drafter's own), got {self.num_draft}")
    if self.drafts not in DRAFTS:
      raise ValueError(f"drafts must be one of {', '.join(DRAFTS)}, got {self.drafts!r}")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    try:
      costs = tuple((float(a), float(b)) for a, b in self.costs)
    except (TypeError, ValueError):
      raise ValueError(f"costs must be (float, float) pairs, got {self.costs!r}") from None
    object.__setattr__(self, "costs", costs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """A decode resolved: the static first argument of every round function.

  Attributes:
    tree: the tree (or dynamic pool, or adaptive candidates' union) drafted each round; the
      root alone for plain decoding.
    kind: the drafter's kind, or "none" for plain decoding.
    drawn: drafted nodes are drawn from the drafter's distribution q and accepted by
      speculative sampling (`DecodeConfig.drafts`).
    max_len: cache slots per sequence.
    max_new_tokens, sampling, eos_ids, pad_id, mesh: as in `DecodeConfig`.
  """

  tree: tree_lib.Tree
  kind: str
  drawn: bool
  max_len: int
  max_new_tokens: int
  sampling: SamplingConfig
  eos_ids: tuple[int, ...]
  pad_id: int
  mesh: Mesh | None

  @property
  def max_depth(self) -> int:
    """P: the longest path a round can accept below the root (drafts and lookup)."""
    return self.tree.max_depth


def resolve_tree(cfg: DecodeConfig, drafter: Drafter | None) -> tree_lib.Tree:
  """The tree (or dynamic pool) drafted each round; the root alone without a drafter."""
  if drafter is None:
    return tree_lib.ROOT_ONLY
  d = drafter.cfg
  greedy = cfg.sampling.greedy
  return tree_specs.parse(
    d.resolve_tree(d.tree_for(greedy, cfg.tree), greedy), cfg.num_draft or d.num_draft
  )


def make_plan(cfg: DecodeConfig, drafter: Drafter | None, width: int) -> Plan:
  """`cfg` resolved for a drafter (None: plain decoding) and prompts `width` tokens wide.

  Raises one clear ValueError when the tree asks more of the drafter than it proposes, the
  adaptive costs do not match the candidates, or the cache cannot hold the prompt, the answer
  and one round's drafts.
  """
  tree = resolve_tree(cfg, drafter)
  kind = "none" if drafter is None else drafter.cfg.kind
  if kind in ("pspec", "medusa") and tree.depth > drafter.cfg.num_draft:
    raise ValueError(
      f"the {kind} drafter proposes at most K={drafter.cfg.num_draft} tokens, the tree needs "
      f"{tree.depth}: lower num_draft or the tree depth"
    )
  if tree.candidates and cfg.costs:
    adaptive.check_costs(tree, cfg.costs)
  needed = width + cfg.max_new_tokens + tree.max_depth
  if cfg.max_len and needed > cfg.max_len:
    raise ValueError(
      f"prompt width {width} + max_new_tokens {cfg.max_new_tokens} + tree depth "
      f"{tree.max_depth} = {needed} does not fit the cache of {cfg.max_len} slots: shorten the "
      "prompt, lower K or raise max_len"
    )
  drawn = (
    not cfg.sampling.greedy
    and cfg.drafts == "sampled"
    and kind not in ("none", "pld")
    and tree.depth > 0
  )
  return Plan(
    tree=tree,
    kind=kind,
    drawn=drawn,
    max_len=cfg.max_len or needed,
    max_new_tokens=cfg.max_new_tokens,
    sampling=cfg.sampling,
    eos_ids=cfg.eos_ids,
    pad_id=cfg.pad_id,
    mesh=cfg.mesh,
  )
