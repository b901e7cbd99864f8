"""The jitted decode loop against a cache-free reference, plus its batching and RNG contracts."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from pspec_jax import accept, cpu_kernel, decode, llama, rounds, sampling, testing, tree_specs
from pspec_jax import tree as tree_lib
from pspec_jax.sampling import SamplingConfig, filtered_logits, select

# The shared tiny target with a wider vocabulary (sampled sequences differ from seed to seed)
# and a context that 9 + 120 tokens exceed.
TINY = testing.TINY.replace(vocab_size=64, max_position_embeddings=128)
PROMPTS = testing.PROMPTS[:3]


@pytest.fixture(scope="module")
def target():
  params = llama.init_params(TINY, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 5 if x.ndim > 2 else x, params)
  return llama.Target(cfg=TINY, params=params)


@jax.jit
def _full_forward_argmax(target, seq_1T):
  features, _ = target(seq_1T, jnp.arange(seq_1T.shape[1])[None])
  return jnp.argmax(target.logits(features)[0], axis=-1)


def reference_greedy(target, prompt, num_new):
  """Plain greedy decoding with a full forward over the whole sequence at every step.

  The sequence is zero-padded to a fixed width (one compilation); causal attention keeps the
  padding from affecting the positions that are read.
  """
  seq = list(prompt)
  for _ in range(num_new):
    padded_seq = jnp.zeros((1, 32), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq))
    seq.append(int(_full_forward_argmax(target, padded_seq)[len(seq) - 1]))
  return seq[len(prompt) :]


def test_greedy_matches_cache_free_reference_on_a_ragged_batch(target):
  tokens, lengths = testing.padded(PROMPTS)
  out = decode.generate(
    target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(max_new_tokens=12)
  )
  for row, prompt in enumerate(PROMPTS):
    assert out.tokens[row].tolist() == reference_greedy(target, prompt, 12)
  assert out.lengths.tolist() == [12] * 3
  assert out.rounds.tolist() == [11] * 3  # one round per token after the prefill's
  np.testing.assert_allclose(out.tau, 1.0)


def test_ragged_batch_equals_each_sequence_alone(target):
  cfg = decode.DecodeConfig(max_new_tokens=10)
  batch = decode.generate(target, *testing.padded(PROMPTS), jax.random.key(0), cfg)
  for row, prompt in enumerate(PROMPTS):
    alone = decode.generate(target, *testing.padded([prompt], width=9), jax.random.key(0), cfg)
    assert batch.tokens[row].tolist() == alone.tokens[0].tolist()


def test_prompts_padded_wide_are_prefilled_at_the_narrowest_width_that_holds_them(target):
  """Prompts padded far past their length (to a prompt set's bucket) are prefilled at the
  narrowest of `rounds.prefill_widths` that holds the longest: nothing past it is computed
  (zeros), and decoding gives the tokens of the prompts padded to their own width."""
  assert rounds.prefill_widths(32) == [32]
  assert rounds.prefill_widths(64) == [64] and rounds.prefill_widths(96) == [64, 96]
  assert rounds.prefill_widths(256) == [64, 128, 256]
  assert rounds.prefill_widths(512) == [128, 256, 512]  # two narrower passes at most
  prefill = jax.jit(rounds._prefill)
  long_prompt = [1 + i % 60 for i in range(70)]
  for prompts, run in ((PROMPTS, 64), ([*PROMPTS, long_prompt], 96)):
    tokens, lengths = testing.padded(prompts, width=96)
    _, hidden, (k, v) = prefill(target, None, jnp.asarray(tokens), jnp.asarray(lengths))
    assert (
      not jnp.any(hidden[:, run:]) and not jnp.any(k[:, :, run:]) and not jnp.any(v[:, :, run:])
    )
    assert jnp.all(jnp.any(hidden[:, :run] != 0, axis=-1))  # pads inside the width run are run
    cfg = decode.DecodeConfig(max_new_tokens=8)
    wide = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
    own_width = testing.padded(prompts, width=max(map(len, prompts)))
    own = decode.generate(target, *own_width, jax.random.key(0), cfg)
    assert wide.tokens.tolist() == own.tokens.tolist()


def test_eos_stops_one_sequence_and_pads_it(target):
  tokens, lengths = testing.padded(PROMPTS)
  free = decode.generate(
    target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(max_new_tokens=12)
  )
  eos = int(free.tokens[0, 3])
  stop_at = free.tokens[0].tolist().index(eos)  # first occurrence
  cfg = decode.DecodeConfig(max_new_tokens=12, eos_ids=(eos,), pad_id=-1)
  out = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  assert out.lengths[0] == stop_at + 1
  assert out.tokens[0, : stop_at + 1].tolist() == free.tokens[0, : stop_at + 1].tolist()
  assert (out.tokens[0, stop_at + 1 :] == -1).all()
  for row in (1, 2):  # the others run until their own EOS or the budget
    seq = free.tokens[row].tolist()
    expected = seq.index(eos) + 1 if eos in seq else 12
    assert out.lengths[row] == expected


def test_sampling_is_reproducible_from_the_seed(target):
  tokens, lengths = testing.padded(PROMPTS)
  cfg = decode.DecodeConfig(
    max_new_tokens=16, sampling=SamplingConfig(temperature=1.5, top_k=20, top_p=0.95)
  )
  a = decode.generate(target, tokens, lengths, jax.random.key(7), cfg)
  b = decode.generate(target, tokens, lengths, jax.random.key(7), cfg)
  c = decode.generate(target, tokens, lengths, jax.random.key(8), cfg)
  assert a.tokens.tolist() == b.tokens.tolist()
  assert a.tokens.tolist() != c.tokens.tolist()


def test_generate_inside_a_user_jit(target):
  tokens, lengths = testing.padded(PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=8)

  @jax.jit
  def user_program(target, tokens, lengths, key):
    out = decode.generate(target, tokens, lengths, key, cfg)
    return out.tokens, jnp.sum(out.lengths)

  tokens_jit, total = user_program(target, tokens, lengths, jax.random.key(0))
  direct = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  assert tokens_jit.tolist() == direct.tokens.tolist()
  assert int(total) == 24


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_yields_exactly_what_generate_returns(target, temperature):
  tokens, lengths = testing.padded(PROMPTS)
  cfg = decode.DecodeConfig(
    max_new_tokens=9, sampling=SamplingConfig(temperature=temperature), eos_ids=(3,)
  )
  out = decode.generate(target, tokens, lengths, jax.random.key(3), cfg)
  streamed = [[] for _ in PROMPTS]
  for new in decode.stream(target, tokens, lengths, jax.random.key(3), cfg):
    for row, ids in enumerate(new):
      streamed[row].extend(ids.tolist())
  for row in range(len(PROMPTS)):
    assert streamed[row] == out.tokens[row, : out.lengths[row]].tolist()


def test_bad_inputs_raise_one_clear_error(target):
  tokens, lengths = testing.padded(PROMPTS)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="empty prompt"):
    decode.generate(
      target, tokens, lengths.at[1].set(0), key, decode.DecodeConfig(max_new_tokens=8)
    )
  with pytest.raises(ValueError, match="does not fit the cache"):
    decode.generate(target, tokens, lengths, key, decode.DecodeConfig(max_new_tokens=8, max_len=20))
  with pytest.raises(ValueError, match="exceeds the target's context"):
    decode.generate(target, tokens, lengths, key, decode.DecodeConfig(max_new_tokens=120))
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(temperature=-0.5)
  with pytest.raises(ValueError, match="max_new_tokens"):
    decode.DecodeConfig(max_new_tokens=0)


def reference_filter(logits, temperature, top_k, top_p):
  """numpy top-k / top-p from their definitions: keep the k best, then the smallest nucleus."""
  z = logits / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros(z.shape, bool)
  keep[order[: top_k or len(z)]] = True
  p = np.exp(z - z.max()) * keep
  p /= p.sum()
  mass = 0.0
  nucleus = np.zeros(z.shape, bool)
  for i in order:
    if not keep[i] or mass >= top_p:
      break
    nucleus[i] = True
    mass += p[i]
  q = p * nucleus
  return q / q.sum()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (6, 0.8)])
def test_sampling_distribution_matches_the_definition(top_k, top_p):
  logits = jax.random.normal(jax.random.key(0), (12,)) * 2
  cfg = SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p)
  expected = reference_filter(np.asarray(logits, np.float64), 0.8, top_k, top_p)
  ours = np.asarray(jax.nn.softmax(filtered_logits(logits[None], cfg)[0]))
  np.testing.assert_allclose(ours, expected, atol=1e-6)
  # And `select` draws from it: chi-square goodness of fit on 20k draws.
  keys = jax.random.split(jax.random.key(1), 20000)
  draws = jax.vmap(functools.partial(select, logits[None], cfg=cfg))(keys)[:, 0]
  counts = np.bincount(np.asarray(draws), minlength=12)
  support = expected > 0
  assert counts[~support].sum() == 0
  assert scipy.stats.chisquare(counts[support], 20000 * expected[support]).pvalue > 1e-3


def test_argmax_and_categorical_equal_jax_s():
  x = jax.random.normal(jax.random.key(0), (3, 5, 1000))
  x = x.at[0, 0, 7].set(9.0).at[0, 0, 3].set(9.0)  # a tie: the first index wins
  x = x.at[1].set(-jnp.inf).at[1, :, 500].set(0.0)  # one finite entry per row
  for kernel in (True, False):  # the CPU kernels (`cpu_kernel.argmax`), then XLA's reductions
    with contextlib.nullcontext() if kernel else cpu_kernel.disabled():
      np.testing.assert_array_equal(sampling.argmax(x), jnp.argmax(x, axis=-1))
      assert int(sampling.argmax(x)[0, 0]) == 3
      for seed in range(5):
        key = jax.random.key(seed)
        drawn = np.asarray(sampling.categorical(key, x))
        assert drawn.shape == (3, 5) and (drawn[1] == 500).all()
        if not kernel:  # Gumbel-max with the same noise; the kernel draws by inverse CDF
          np.testing.assert_array_equal(drawn, jax.random.categorical(key, x, axis=-1))


def test_vocabulary_rows_take_the_cpu_kernels_where_they_are_built():
  x = jnp.zeros((2, 100))
  key = jax.random.key(0)
  calls = {
    "pspec_vocab_argmax": lambda: sampling.argmax(x),
    "pspec_vocab_softmax": lambda: sampling.softmax(x),
    "pspec_vocab_draws": lambda: (sampling.categorical(key, x), sampling.draws(key, x, 3)),
    "pspec_vocab_rejection": lambda: accept.sampled_walk(
      x[None],
      jnp.zeros((1, 2), jnp.int32),
      tree_lib.batched(tree_specs.parse("paths:0", 1), 1),
      jnp.asarray([[-1, 0]]),
      x[None, :1],
      1,
      key,
      SamplingConfig(temperature=1.0),
    ),  # fmt: skip
  }
  for target, fn in calls.items():
    assert target in jax.jit(fn).lower().as_text(), target
    with cpu_kernel.disabled():
      assert "pspec_vocab" not in jax.jit(fn).lower().as_text(), target


def _cache_copies_in_loop(target, tied: bool) -> int:
  """Copies of a cache buffer in the compiled plain decoding loop (`decode.run`, the program a
  decode runs its rounds in), with the commit's write tied to the pass (`rounds._tied_to_pass`)
  or not."""
  cfg = decode.DecodeConfig(max_new_tokens=8, eos_ids=(3,), pad_id=0)
  tokens, lengths = testing.padded(PROMPTS[:1])
  plan = decode.make_plan(cfg, None, tokens.shape[1])
  shape = f"f32[1,{plan.max_len},{TINY.num_kv_heads},{TINY.head_dim}]"
  original = rounds._tied_to_pass
  if not tied:
    rounds._tied_to_pass = lambda kv, bonus: kv
  jax.clear_caches()  # `decode`'s jitted loop would reuse its program traced the other way
  try:
    state = decode.init(plan, target, None, tokens, lengths, jax.random.key(0))
    stop, restart = np.int32(cfg.max_new_tokens), np.bool_(False)  # `decode.run` as decoding
    text = decode.run.lower(plan, target, None, state, stop, restart).compile().as_text()
  finally:
    rounds._tied_to_pass = original
  return sum(
    1
    for line in text.splitlines()
    if f"= {shape}" in line and " copy(" in line and "broadcast" not in line
  )


def test_a_decoding_step_updates_the_cache_in_place():
  """The commit's write waits for the pass (`rounds._tied_to_pass`): without it XLA copies the
  caches it cannot prove are read before they are written, twice per step."""
  target = testing.make_target(5, cfg=TINY.replace(num_layers=6))
  assert _cache_copies_in_loop(target, tied=False) >= 2 * 6 * 2
  assert _cache_copies_in_loop(target, tied=True) == 0
