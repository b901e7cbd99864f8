"""Decoding: the whole generation inside one jitted `jax.lax.while_loop`.

State between rounds (DESIGN.md section 3): the target cache holds x_1..x_n; the *bonus* token
x_{n+1}, chosen from p_n, is known but not yet in the cache. A round feeds the bonus, gets
p_{n+1}, and chooses the next bonus. Plain auto-regressive decoding is the round whose token
tree is the root alone; drafters add nodes below the root and share the rest of the round.

`generate` runs prefill plus rounds until every sequence is done, all on device. `stream`
drives the same jitted round function from the host and yields each round's new tokens.
Shapes are fixed by (batch, prompt width, max_new_tokens), so prompts padded to the same width
reuse the compiled program.
"""

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pspec_jax.kv_cache import KVCache
from pspec_jax.llama import Target
from pspec_jax.sampling import SamplingConfig, select


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """Static decoding settings (hashable: a change recompiles).

  Attributes:
    max_new_tokens: generation budget per sequence, EOS included.
    sampling: greedy (default) or temperature / top-k / top-p sampling.
    eos_ids: token ids that end a sequence (it is kept in the output).
    max_len: cache slots per sequence; 0 means prompt width + max_new_tokens.
    pad_id: fills `DecodeOutput.tokens` past each sequence's length.
  """

  max_new_tokens: int = 128
  sampling: SamplingConfig = SamplingConfig()
  eos_ids: tuple[int, ...] = ()
  max_len: int = 0
  pad_id: int = 0

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.max_len < 0:
      raise ValueError(f"max_len must be >= 0 (0: derived), got {self.max_len}")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))


@struct.dataclass
class DecodeState:
  cache: KVCache  # target cache; lengths[b] = n, the bonus excluded
  tokens: jax.Array  # [B, W] prompt then generated tokens; the bonus is tokens[b, n]
  prompt_lengths: jax.Array  # [B]
  done: jax.Array  # [B] bool
  rounds: jax.Array  # [B] target forward passes (prefill included) while active
  key: jax.Array  # PRNG key, folded with the round number
  step: jax.Array  # scalar: rounds run so far

  @property
  def num_tokens(self) -> jax.Array:
    """[B] tokens known per sequence: the cache plus the bonus."""
    return self.cache.lengths + 1

  @property
  def num_generated(self) -> jax.Array:
    return self.num_tokens - self.prompt_lengths


@struct.dataclass
class DecodeOutput:
  tokens: jax.Array  # [B, max_new_tokens] generated ids, pad_id past `lengths`
  lengths: jax.Array  # [B] generated tokens, EOS included
  rounds: jax.Array  # [B] target forward passes, prefill included

  @property
  def tau(self) -> jax.Array:
    """[B] mean tokens per target forward pass (1 for plain decoding)."""
    return self.lengths / jnp.maximum(self.rounds, 1)


def _is_eos(tokens: jax.Array, cfg: DecodeConfig) -> jax.Array:
  if not cfg.eos_ids:
    return jnp.zeros(tokens.shape, jnp.bool_)
  return jnp.isin(tokens, jnp.asarray(cfg.eos_ids, jnp.int32))


def init(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig,
) -> DecodeState:
  """Prefills the cache with the prompts and chooses the first bonus token."""
  batch, width = prompt_tokens.shape
  total = width + cfg.max_new_tokens
  prompt_lengths = prompt_lengths.astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  features, kv = target(prompt_tokens, positions)
  # p_n sits at each sequence's last real token; pads after it are never read.
  last = jnp.take_along_axis(features, (prompt_lengths - 1)[:, None, None], axis=1)
  first = select(target.logits(last)[:, 0], jax.random.fold_in(key, 0), cfg.sampling)
  cache = target.empty_cache(batch, cfg.max_len or total).write(kv, prompt_lengths)
  is_prompt = jnp.arange(width)[None, :] < prompt_lengths[:, None]
  tokens = jnp.zeros((batch, total), jnp.int32)
  tokens = tokens.at[:, :width].set(jnp.where(is_prompt, prompt_tokens, 0))
  tokens = tokens.at[jnp.arange(batch), prompt_lengths].set(first)
  return DecodeState(
    cache=cache,
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    done=_is_eos(first, cfg) | (cfg.max_new_tokens <= 1),
    rounds=jnp.ones((batch,), jnp.int32),
    key=key,
    step=jnp.zeros((), jnp.int32),
  )


def round_step(target: Target, state: DecodeState, cfg: DecodeConfig) -> DecodeState:
  """One round: the target consumes the bonus token and the next one is chosen.

  Finished sequences idle: their cache length, tokens and counters stay as they are.
  """
  batch, total = state.tokens.shape
  rows = jnp.arange(batch)
  active = ~state.done
  n = state.cache.lengths
  bonus = state.tokens[rows, n]
  features, kv = target(bonus[:, None], n[:, None], state.cache)
  step = state.step + 1
  chosen = select(target.logits(features)[:, 0], jax.random.fold_in(state.key, step), cfg.sampling)
  cache = state.cache.write(kv, active)
  # Inactive rows write to index `total`, which mode="drop" discards.
  tokens = state.tokens.at[rows, jnp.where(active, n + 1, total)].set(chosen, mode="drop")
  state = state.replace(cache=cache, tokens=tokens, step=step, rounds=state.rounds + active)
  finished = _is_eos(chosen, cfg) | (state.num_generated >= cfg.max_new_tokens)
  return state.replace(done=state.done | (active & finished))


def finish(state: DecodeState, cfg: DecodeConfig) -> DecodeOutput:
  """Cuts each sequence's generated tokens out of the state."""
  lengths = state.num_generated
  index = state.prompt_lengths[:, None] + jnp.arange(cfg.max_new_tokens)[None, :]
  tokens = jnp.take_along_axis(state.tokens, index, axis=1, mode="clip")
  valid = jnp.arange(cfg.max_new_tokens)[None, :] < lengths[:, None]
  return DecodeOutput(
    tokens=jnp.where(valid, tokens, cfg.pad_id), lengths=lengths, rounds=state.rounds
  )


def _generate(target, prompt_tokens, prompt_lengths, key, cfg):
  state = init(target, prompt_tokens, prompt_lengths, key, cfg)
  state = jax.lax.while_loop(
    lambda s: ~jnp.all(s.done), lambda s: round_step(target, s, cfg), state
  )
  return finish(state, cfg)


_generate_jit = jax.jit(_generate, static_argnames="cfg")
_init_jit = jax.jit(init, static_argnames="cfg")
_round_jit = jax.jit(round_step, static_argnames="cfg", donate_argnames="state")


def check_inputs(target: Target, prompt_tokens, prompt_lengths, cfg: DecodeConfig) -> None:
  """Raises one clear ValueError for inputs the jitted loop cannot handle.

  Shapes are always checked; lengths only when they are concrete (not inside a user's jit).
  """
  if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
    raise ValueError(
      f"prompt_tokens must be [batch, width] and prompt_lengths [batch], got "
      f"{prompt_tokens.shape} and {prompt_lengths.shape}"
    )
  width = prompt_tokens.shape[1]
  needed = width + cfg.max_new_tokens
  if cfg.max_len and needed > cfg.max_len:
    raise ValueError(
      f"prompt width {width} + max_new_tokens {cfg.max_new_tokens} = {needed} does not fit "
      f"the cache of {cfg.max_len} slots: shorten the prompt or raise max_len"
    )
  context = target.cfg.max_position_embeddings
  if needed > context:
    raise ValueError(
      f"prompt width {width} + max_new_tokens {cfg.max_new_tokens} = {needed} exceeds the "
      f"target's context of {context} tokens: shorten the prompt or lower max_new_tokens"
    )
  try:
    lengths = np.asarray(prompt_lengths)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return
  if np.any(lengths < 1):
    raise ValueError("empty prompt: every sequence needs at least one token")
  if np.any(lengths > width):
    raise ValueError(f"prompt_lengths exceed the prompt width {width}: {lengths.tolist()}")


def generate(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
) -> DecodeOutput:
  """Generates up to `cfg.max_new_tokens` tokens per prompt, entirely on device.

  Pure and jittable: it may be called inside a user's own `jax.jit` (target params and token
  arrays traced, `cfg` static).

  Args:
    target: the target model and its parameters.
    prompt_tokens: [B, T] int token ids, right-padded.
    prompt_lengths: [B] real tokens per prompt (>= 1).
    key: PRNG key; unused when greedy.
    cfg: decoding settings.

  Returns:
    DecodeOutput with the generated tokens, their count and per-sequence stats.
  """
  check_inputs(target, prompt_tokens, prompt_lengths, cfg)
  return _generate_jit(target, jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths), key, cfg)


def stream(
  target: Target,
  prompt_tokens: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  cfg: DecodeConfig = DecodeConfig(),
) -> Iterator[list[np.ndarray]]:
  """Like `generate`, one round at a time: yields each sequence's new tokens per round.

  Every yield is a list of B int arrays (empty for sequences that are done). Concatenated, they
  are exactly `generate`'s tokens for the same inputs.
  """
  check_inputs(target, prompt_tokens, prompt_lengths, cfg)
  state = _init_jit(target, jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths), key, cfg)
  seen = np.asarray(prompt_lengths)
  while True:
    tokens, known, done = jax.device_get((state.tokens, state.num_tokens, state.done))
    yield [tokens[b, seen[b] : known[b]] for b in range(len(seen))]
    seen = known
    if done.all():
      return
    state = _round_jit(target, state, cfg)
