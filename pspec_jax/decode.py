"""Decoding: speculative rounds inside one jitted `jax.lax.while_loop` (docs/design.md
section 3).

`generate(target, prompt_tokens, prompt_lengths, key, cfg, drafter)` resolves `cfg` into a
`Plan` (`make_plan`), prefills (`init`), runs rounds (`run`, `pspec_jax.rounds`) until every
sequence is done, all on device, and cuts the answers out (`finish`). `stream` steps the same
compiled `run` a round at a time from the host and yields each round's tokens. Plain
auto-regressive decoding (`drafter=None`) is the round whose tree is the root alone. Shapes are
fixed by (batch, prompt width, max_new_tokens, tree), so prompts padded to the same width reuse
the compiled programs; an adaptive tree's round costs are arrays in the state, not part of
them.

The round functions are exported here jitted once, the plan their first, static argument:
`init`, `run`, `verify`, `commit`, `draft`, `round_step` (and `accept_path`), for programs
that run or time a round's parts.

Sharded decoding: `shard` places target and drafter parameters on a mesh by the logical-axis
rules of training (`sharding.RULES`: heads, MLP width and vocabulary over `tensor`), and
`DecodeConfig.mesh` keeps the batch over `data` and the caches over batch and kv heads.
"""

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from pspec_jax import adaptive, llama, rounds, sharding
from pspec_jax import drafter as drafter_lib
from pspec_jax.decode_plan import DRAFTS, DecodeConfig, Plan, make_plan, resolve_tree
from pspec_jax.drafter import Drafter
from pspec_jax.llama import Target
from pspec_jax.rounds import CACHE_AXES, DecodeState, Verified

__all__ = [
  "CACHE_AXES",
  "DRAFTS",
  "DecodeConfig",
  "DecodeOutput",
  "DecodeState",
  "Plan",
  "Verified",
  "accept_path",
  "check_inputs",
  "commit",
  "compile_generate",
  "costs",
  "draft",
  "finish",
  "generate",
  "init",
  "make_plan",
  "resolve_tree",
  "round_step",
  "run",
  "shard",
  "stream",
  "verify",
]


@struct.dataclass
class DecodeOutput:
  tokens: jax.Array  # [B, max_new_tokens] generated ids, pad_id past `lengths`
  lengths: jax.Array  # [B] generated tokens, EOS included
  rounds: jax.Array  # [B] verification rounds (the prefill, which gives token 1, excluded)
  accepted_per_depth: jax.Array  # [B, P] rounds that accepted a draft token at depth d + 1
  chosen: jax.Array | None = None  # [C] rounds verified with each adaptive candidate
  chained: jax.Array | None = None  # [C] those of them that also verified its lookup chain

  @property
  def tau(self) -> jax.Array:
    """[B] mean tokens per verification round: accepted drafts + 1 (1 for plain decoding)."""
    return (self.lengths - 1) / jnp.maximum(self.rounds, 1)


def finish(plan: Plan, state: DecodeState) -> DecodeOutput:
  """Cuts each sequence's generated tokens out of the state."""
  lengths = state.num_generated
  index = state.prompt_lengths[:, None] + jnp.arange(plan.max_new_tokens)[None, :]
  tokens = jnp.take_along_axis(state.tokens, index, axis=1, mode="clip")
  valid = jnp.arange(plan.max_new_tokens)[None, :] < lengths[:, None]
  return DecodeOutput(
    tokens=jnp.where(valid, tokens, plan.pad_id),
    lengths=lengths,
    rounds=state.rounds,
    accepted_per_depth=state.accepted,
    chosen=None if state.adapt is None else state.adapt.chosen,
    chained=None if state.adapt is None else state.adapt.chained,
  )


def shard(mesh: Mesh, target: Target, drafter: Drafter | None = None):
  """Target and drafter with their parameters placed on `mesh` by the logical-axis rules.

  Returns (target, drafter); decode them with `DecodeConfig(mesh=mesh)`.
  """

  def place(params, init_boxed, cfg):
    return jax.device_put(params, sharding.param_shardings(init_boxed, cfg, mesh))

  target = target.replace(params=place(target.params, llama.init_boxed, target.cfg))
  if drafter is not None:
    replicated = sharding.replicated(mesh)
    drafter = drafter.replace(
      params=place(drafter.params, drafter_lib.init_boxed, drafter.cfg),
      vocab=None if drafter.vocab is None else jax.device_put(drafter.vocab, replicated),
      head=None if drafter.head is None else jax.device_put(drafter.head, replicated),
    )
  return target, drafter


def _generate(plan, target, drafter, prompt_tokens, prompt_lengths, key, costs):
  """`generate` as one function of its arrays (`compile_generate` compiles it whole)."""
  state = _init(plan, target, drafter, prompt_tokens, prompt_lengths, key, costs)
  return finish(plan, rounds.run(plan, target, drafter, state, *_DECODING))


def _init(plan, target, drafter, prompt_tokens, prompt_lengths, key, costs=None):
  """`rounds.init`, the prompts kept over the mesh's batch axis."""
  prompt_tokens = sharding.constrain(prompt_tokens, ("batch", "length"), plan.mesh)
  prompt_lengths = sharding.constrain(prompt_lengths, ("batch",), plan.mesh)
  return rounds.init(plan, target, drafter, prompt_tokens, prompt_lengths, key, costs)


# `run`'s stop and restart when decoding: every round up to the budget, none restarted. They are
# arrays, so calibrating (`infer.calibration`: a few rounds, each restarted) runs the same program.
_DECODING = (np.int32(np.iinfo(np.int32).max), np.bool_(False))

# The library's jitted entry points, the plan static. A decode runs three programs: `init`
# (the prefill and the first draft), `run` (its rounds; it donates the state, so the caches are
# updated in place) and `_finish_jit`; `stream` steps `run` a round at a time.
init = jax.jit(_init, static_argnums=0)
verify = jax.jit(rounds.verify, static_argnums=0)
accept_path = jax.jit(rounds.accept_path, static_argnums=0)
commit = jax.jit(rounds.commit, static_argnums=0)
draft = jax.jit(rounds.draft, static_argnums=0)
round_step = jax.jit(rounds.round_step, static_argnums=0)
run = jax.jit(rounds.run, static_argnums=0, donate_argnums=3)
_finish_jit = jax.jit(finish, static_argnums=0)
_generate_jit = jax.jit(_generate, static_argnums=0)


def check_inputs(
  plan: Plan, target: Target, drafter: Drafter | None, prompt_tokens, prompt_lengths
) -> None:
  """Raises one clear ValueError for inputs the jitted loop cannot handle.

  Shapes are always checked; lengths only when they are concrete (not inside a user's jit).
  """
  if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
    raise ValueError(
      f"prompt_tokens must be [batch, width] and prompt_lengths [batch], got "
      f"{prompt_tokens.shape} and {prompt_lengths.shape}"
    )
  if drafter is not None:
    check_drafter(target, drafter)
  width = prompt_tokens.shape[1]
  needed = width + plan.max_new_tokens + plan.max_depth
  context = target.cfg.max_position_embeddings
  if needed > context:
    raise ValueError(
      f"prompt width {width} + max_new_tokens {plan.max_new_tokens} + tree depth "
      f"{plan.max_depth} = {needed} exceeds the target's context of {context} tokens: shorten "
      "the prompt or lower max_new_tokens"
    )
  try:
    lengths = np.asarray(prompt_lengths)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return
  if np.any(lengths < 1):
    raise ValueError("empty prompt: every sequence needs at least one token")
  if np.any(lengths > width):
    raise ValueError(f"prompt_lengths exceed the prompt width {width}: {lengths.tolist()}")


def check_drafter(target: Target, drafter: Drafter) -> None:
  """The drafter must have been built for this target."""
  d, t = drafter.cfg, target.cfg
  if (d.vocab_size, d.hidden_size) != (t.vocab_size, t.hidden_size):
    raise ValueError(
      f"the drafter was built for target {d.target_name!r} (vocab {d.vocab_size}, width "
      f"{d.hidden_size}), not for {t.name!r} (vocab {t.vocab_size}, width {t.hidden_size})"
    )


def _planned(target, drafter, prompt_tokens, prompt_lengths, cfg) -> Plan:
  """The plan for these inputs, which are checked (the boundary of `generate` and `stream`)."""
  plan = make_plan(cfg, drafter, prompt_tokens.shape[1])
  check_inputs(plan, target, drafter, prompt_tokens, prompt_lengths)
  return plan


def generate(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
  drafter: Drafter | None = None,
) -> DecodeOutput:
  """Generates up to `cfg.max_new_tokens` tokens per prompt, entirely on device.

  Speculative with a drafter, plain auto-regressive without; the output is the target's either
  way (token for token when greedy, in distribution when sampling). Pure and jittable: it may
  be called inside a user's own `jax.jit` (params and token arrays traced, `cfg` static).

  Args:
    target: the target model and its parameters.
    prompt_tokens: [B, T] int token ids, right-padded.
    prompt_lengths: [B] real tokens per prompt (>= 1).
    key: PRNG key; unused when greedy.
    cfg: decoding settings (tree and K included).
    drafter: a drafter built for this target, or None for plain decoding.

  Returns:
    DecodeOutput with the generated tokens, their count and per-sequence stats.
  """
  plan = _planned(target, drafter, prompt_tokens, prompt_lengths, cfg)
  tokens, lengths = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
  if drafter is not None:
    # A drafter loaded for the target has its head (`drafter_files.load_drafter`); else it is
    # gathered here, once per call, not every round.
    drafter = drafter.with_head(target)
  state = init(plan, target, drafter, tokens, lengths, key, costs(cfg, plan))
  return _finish_jit(plan, run(plan, target, drafter, state, *_DECODING))


def costs(cfg: DecodeConfig, plan: Plan) -> jax.Array | None:
  """The adaptive tree's round costs `init` takes, [C, 2]: `DecodeConfig.costs`, else
  `adaptive.default_costs`' guess; None for any other tree. They are not part of the plan: they
  ride in the state, so new costs need no compilation."""
  if not plan.tree.candidates:
    return None
  pairs = cfg.costs or adaptive.default_costs(plan.tree, plan.kind)
  return jnp.asarray(pairs, jnp.float32)


def compile_generate(
  target: Target,
  prompt_tokens,
  prompt_lengths,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
  drafter: Drafter | None = None,
) -> jax.stages.Compiled:
  """`generate`'s program compiled for these arguments, which may be abstract (shapes with
  shardings): for its memory and cost analysis; nothing runs and nothing is allocated."""
  plan = make_plan(cfg, drafter, prompt_tokens.shape[1])
  if drafter is not None:
    drafter = drafter.with_head(target)
  return _generate_jit.lower(
    plan, target, drafter, prompt_tokens, prompt_lengths, key, costs(cfg, plan)
  ).compile()


def stream(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
  drafter: Drafter | None = None,
) -> Iterator[list[np.ndarray]]:
  """Like `generate`, one round at a time: yields each sequence's new tokens per round.

  Every yield is a list of B int arrays (empty for sequences that are done). Concatenated, they
  are exactly `generate`'s tokens for the same inputs.
  """
  plan = _planned(target, drafter, prompt_tokens, prompt_lengths, cfg)
  tokens, lengths = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
  if drafter is not None:
    drafter = drafter.with_head(target)
  state = init(plan, target, drafter, tokens, lengths, key, costs(cfg, plan))
  seen = np.asarray(prompt_lengths)
  while True:
    tokens, known, done = jax.device_get((state.tokens, state.num_tokens, state.done))
    yield [tokens[b, seen[b] : known[b]] for b in range(len(seen))]
    seen = known
    if done.all():
      return
    state = run(plan, target, drafter, state, state.step + 1, _DECODING[1])
