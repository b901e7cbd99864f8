"""A drafter's configuration: kind, K, trees, widths, architecture options and the target it
was built for (docs/design.md sections 2 and 5). Frozen and hashable: a static jit argument.

`pspec_jax.drafter` re-exports it with the modules that read it.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from pspec_jax import tree_specs
from pspec_jax.llama import LlamaConfig, RopeScaling

__all__ = ["DEFAULT_TREES", "KINDS", "MASK_INPUTS", "DrafterConfig"]

KINDS = ("pspec", "eagle", "medusa", "pld")
MASK_INPUTS = ("per_depth", "shared")
DEFAULT_TREES = ("fixed", "adaptive")
Dtype = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig:
  """A drafter's kind, draft length, decoder-layer widths and the target it was built for.

  Attributes:
    kind: one of KINDS.
    num_draft: K, the draft tokens per round it was built for (pspec: K-1 mask vectors;
      medusa: K heads). Decoding may use fewer.
    tree: its fixed tree (`tree_specs.parse`), greedy: the tree named `fixed`.
    sampling_tree: its fixed tree at temperature > 0; "" is `tree`. Sampled drafts are
      accepted less often than greedy ones, so a smaller tree (or prompt lookup alone) can be
      the faster one there.
    default_tree: what it decodes with unless told otherwise (`tree_for`): "fixed" (`tree`,
      `sampling_tree`) or "adaptive" (a tree chosen each round from `adaptive` or
      `sampling_adaptive` by the acceptance seen and this machine's round costs).
    adaptive: the candidate trees (`A|B|...`) the tree `adaptive` chooses from each round;
      "" is `tree_specs.ADAPTIVE`.
    sampling_adaptive: its candidates at temperature > 0; "" is `adaptive`. A lookup chain
      of sampled text is seldom accepted, and a set with one makes every round carry its
      width (the pending pairs, the accepted path), so a set without chains can be the faster
      one there.
    target_name, vocab_size, hidden_size: identity of the target (checked at load time).
    num_heads, num_kv_heads, head_dim, intermediate_size: the drafter layer's widths.
    num_layers: decoder layers of pspec and eagle (1: EAGLE-1's single layer).
    feature_layers: target decoder layers (0-based) whose output hidden states pspec reads,
      concatenated and projected to the drafter's width (EAGLE-3's low/middle/high fusion);
      () reads the target's final feature f_t alone. The target returns them from the passes
      it runs anyway (prefill, verification), never from an extra one.
    mask_input: pspec's mask-slot inputs: "per_depth" learns a vector m_d per depth,
      "shared" one vector for every depth (P-EAGLE), the slots told apart by their positions.
    rope_theta, rope_scaling, rms_norm_eps: as the target's.
    max_ngram: pld's longest n-gram.
    draft_vocab_size: V', the tokens the drafter can propose (the most frequent ones of its
      training data, stored with it); 0 means the target's whole vocabulary. A smaller draft
      vocabulary makes the drafter's LM head (the target's, restricted to those rows) cheaper.
    weight_layout: how its dense weights are stored (`LlamaConfig.weight_layout`): the
      target's, chosen when the target is loaded; never written to a drafter file.
  """

  kind: str
  num_draft: int = 4
  tree: str = "chain"
  sampling_tree: str = ""
  default_tree: str = "fixed"
  adaptive: str = ""
  sampling_adaptive: str = ""
  target_name: str
  vocab_size: int
  hidden_size: int
  num_heads: int = 1
  num_kv_heads: int = 1
  head_dim: int = 0
  intermediate_size: int = 1
  num_layers: int = 1
  feature_layers: tuple[int, ...] = ()
  mask_input: str = "per_depth"
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  max_ngram: int = 3
  draft_vocab_size: int = 0
  weight_layout: str = "plain"
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown drafter kind {self.kind!r}: use one of {', '.join(KINDS)}")
    if self.default_tree not in DEFAULT_TREES:
      raise ValueError(
        f"DrafterConfig.default_tree must be one of {', '.join(DEFAULT_TREES)}, "
        f"got {self.default_tree!r}"
      )
    if self.num_draft < 1:
      raise ValueError(f"DrafterConfig.num_draft (K) must be >= 1, got {self.num_draft}")
    object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
    layered = self.kind in ("pspec", "eagle")
    if self.num_layers < 1 or (self.num_layers > 1 and not layered):
      raise ValueError(
        f"DrafterConfig.num_layers must be >= 1, and 1 for a {self.kind} drafter, "
        f"got {self.num_layers}"
      )
    bad = any(i < 0 for i in self.feature_layers)
    if bad or len(set(self.feature_layers)) < len(self.feature_layers):
      raise ValueError(
        f"DrafterConfig.feature_layers must be distinct target layers >= 0, "
        f"got {self.feature_layers}"
      )
    if self.feature_layers and self.kind != "pspec":
      # eagle drafts on from its own g in place of the next feature, learnt by regression onto
      # f; fused layers would need EAGLE-3's training on its own drafts, which is not built.
      raise ValueError(f"feature_layers is for pspec drafters; a {self.kind} drafter reads f_t")
    if self.mask_input not in MASK_INPUTS or (self.mask_input == "shared" and self.kind != "pspec"):
      raise ValueError(
        f"DrafterConfig.mask_input must be one of {', '.join(MASK_INPUTS)} ('shared' for "
        f"pspec only), got {self.mask_input!r} for a {self.kind} drafter"
      )
    if self.max_ngram < 1:
      raise ValueError(f"DrafterConfig.max_ngram must be >= 1, got {self.max_ngram}")
    if not 0 <= self.draft_vocab_size <= self.vocab_size:
      raise ValueError(
        f"DrafterConfig.draft_vocab_size must be in [0, {self.vocab_size}], "
        f"got {self.draft_vocab_size}"
      )
    for tree in (self.tree, self.sampling_tree):
      if tree:  # fails early on an unknown preset
        tree_specs.parse(self.resolve_tree(tree), self.num_draft)
    for candidates in (self.adaptive, self.sampling_adaptive):
      if candidates:
        tree_specs.parse(f"adaptive:{candidates}", self.num_draft)

  @classmethod
  def for_target(cls, kind: str, target: LlamaConfig, **overrides) -> "DrafterConfig":
    """A drafter whose layer has the target's block widths."""
    settings = dict(
      kind=kind,
      target_name=target.name,
      vocab_size=target.vocab_size,
      hidden_size=target.hidden_size,
      num_heads=target.num_heads,
      num_kv_heads=target.num_kv_heads,
      head_dim=target.head_dim,
      intermediate_size=target.intermediate_size,
      rope_theta=target.rope_theta,
      rope_scaling=target.rope_scaling,
      rms_norm_eps=target.rms_norm_eps,
      weight_layout=target.weight_layout,
      dtype=target.dtype,
      param_dtype=target.param_dtype,
    )
    return cls(**(settings | overrides))

  @property
  def layer(self) -> LlamaConfig:
    """The decoder layer's config (the target's block type)."""
    return LlamaConfig(
      name=f"{self.kind}-drafter",
      vocab_size=self.vocab_size,
      hidden_size=self.hidden_size,
      intermediate_size=self.intermediate_size,
      num_layers=1,
      num_heads=self.num_heads,
      num_kv_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      rope_theta=self.rope_theta,
      rope_scaling=self.rope_scaling,
      rms_norm_eps=self.rms_norm_eps,
      scan_layers=False,
      weight_layout=self.weight_layout,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
    )

  @property
  def feature_width(self) -> int:
    """E, the width of the target feature h_t the drafter reads: D, or D per feature layer."""
    return self.hidden_size * max(len(self.feature_layers), 1)

  def replace(self, **changes) -> "DrafterConfig":
    return dataclasses.replace(self, **changes)

  def tree_for(self, greedy: bool, tree: str = "") -> str:
    """The name of the tree this drafter decodes with, greedy or sampling, when asked for `tree`:
    "" is its default (`default_tree`), `fixed` its fixed tree (`tree`, `sampling_tree`); any
    other name is itself (`adaptive` included: `resolve_tree` spells out its candidates)."""
    tree = tree or self.default_tree
    if tree == "fixed":
      return self.tree if greedy else self.sampling_tree or self.tree
    return tree

  def resolve_tree(self, tree: str, greedy: bool = True) -> str:
    """`tree` with `adaptive` spelled out as this drafter's candidate set, greedy or
    sampling."""
    candidates = self.adaptive if greedy else self.sampling_adaptive or self.adaptive
    if tree == "adaptive" and candidates:
      return f"adaptive:{candidates}"
    return tree
