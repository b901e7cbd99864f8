"""Speculative decoding end to end: lossless for every drafter kind, tau accounting, sampling."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import checkpoints, cpu_kernel, decode, testing, tree_specs
from pspec_jax import drafter as drafter_lib
from pspec_jax import propose as propose_lib
from pspec_jax import tree as tree_lib
from pspec_jax.sampling import SamplingConfig

KINDS = ("pspec", "eagle", "medusa", "pld")


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


def assert_greedy_lossless(target, drafter, tree):
  """Greedy decoding of PROMPTS with `drafter` on `tree` gives plain decoding's tokens, and tau
  counts every token after the prefill's once; returns (config, plain, speculative) outputs."""
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=24, eos_ids=(3,), tree=tree)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  spec = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  assert spec.tokens.tolist() == plain.tokens.tolist()
  assert spec.lengths.tolist() == plain.lengths.tolist()
  np.testing.assert_allclose(spec.tau * spec.rounds, spec.lengths - 1, rtol=1e-6)
  return cfg, plain, spec


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", ["chain", "sparse8", "dynamic:6"])
def test_greedy_speculative_equals_plain_greedy(target, kind, tree):
  _, plain, spec = assert_greedy_lossless(target, testing.drafter_for(kind, target), tree)
  assert (spec.rounds <= plain.rounds).all()


# Drafter architecture options (docs/design.md section 5): fused target layers, deeper drafters,
# one shared mask vector, and combinations.
OPTIONS = [
  ("pspec", dict(feature_layers=(1, 0))),
  ("pspec", dict(feature_layers=(0,), num_layers=2)),
  ("pspec", dict(num_layers=3)),
  ("pspec", dict(mask_input="shared")),
  ("pspec", dict(feature_layers=(0, 1), num_layers=2, mask_input="shared")),
  ("eagle", dict(num_layers=2)),
]


# Each option with one of three trees in turn: every option and every tree, each compiled once.
OPTION_TREES = ["chain", "sparse8", "dynamic:6+lookup:2"]


@pytest.mark.parametrize(
  ("kind", "options", "tree"),
  [(*o, OPTION_TREES[i % len(OPTION_TREES)]) for i, o in enumerate(OPTIONS)],
)
def test_greedy_speculative_equals_plain_greedy_with_drafter_options(target, kind, options, tree):
  drafter = testing.drafter_for(kind, target, **options)
  assert_greedy_lossless(target, drafter, tree)  # batch 4, ragged
  tokens, lengths = testing.padded(testing.PROMPTS[2:3], width=9)  # batch 1
  cfg = decode.DecodeConfig(max_new_tokens=20, tree=tree)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  spec = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  assert spec.tokens.tolist() == plain.tokens.tolist()


@pytest.mark.parametrize(("kind", "options"), OPTIONS[-2:])
def test_drafter_options_stay_lossless_with_panel_weights(target, kind, options):
  packed = target.with_weight_layout("panels")
  drafter = testing.drafter_for(kind, packed, **options)
  assert drafter.cfg.weight_layout == "panels"
  assert_greedy_lossless(packed, drafter, "sparse8")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["kernel", "xla"])
def test_greedy_speculative_equals_plain_greedy_with_panel_weights(target, kind, path):
  # The CPU's decoding layout (`pspec_jax.panels`), with widths off the 64-column panels, its
  # products through the CPU panel kernel and through XLA.
  assert path == "xla" or cpu_kernel.available(), cpu_kernel.describe()
  packed = target.with_weight_layout("panels")
  drafter = testing.drafter_for(kind, packed)
  assert drafter.cfg.weight_layout == "panels"
  with cpu_kernel.disabled() if path == "xla" else contextlib.nullcontext():
    for tree in ("sparse8", "dynamic:6"):
      assert_greedy_lossless(packed, drafter, tree)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("gguf") / "blocks.gguf"
  testing.save_gguf_llama(path, tied=False)
  return str(path)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_plain_greedy_with_block_quantised_weights(gguf_path, kind):
  # A GGUF target decoding from its own Q4_1 and Q8_0 blocks on the CPU kernel (8-bit
  # activations): each drafter kind gives the tokens plain decoding gives, with drafted nodes
  # and with the prompt-lookup chain, which the looping greedy answers accept.
  assert cpu_kernel.available(), cpu_kernel.describe()
  blocks = checkpoints.load_target(gguf_path, weight_layout="decode")
  assert {x.dtype for x in jax.tree.leaves(blocks.params)} == {
    np.dtype("float32"),
    np.dtype("uint8"),
  }
  drafter = testing.drafter_for(kind, blocks)
  assert_greedy_lossless(blocks, drafter, "sparse8")
  _, _, spec = assert_greedy_lossless(blocks, drafter, "sparse8+lookup:6")
  assert (spec.tau > 1).any()


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
@pytest.mark.parametrize("layout", ["plain", "panels"])
def test_a_restricted_draft_vocabulary_stays_lossless_and_drafts_from_it(target, kind, layout):
  target = target.with_weight_layout(layout)
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=24, tree="sparse8")
  vocab = [9, 2, 14, 5, 7, 0]
  drafter = drafter_lib.random_drafter(kind, target, jax.random.key(1), draft_vocab_size=6)
  drafter = drafter.replace(vocab=jnp.asarray(vocab, jnp.int32))
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  spec = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  assert spec.tokens.tolist() == plain.tokens.tolist()
  assert spec.lengths.tolist() == plain.lengths.tolist()
  # Every drafted node is a draft-vocabulary token, with the head gathered once or per call.
  pool = tree_specs.parse("sparse8", 4)
  pairs = propose_lib.Pairs(
    tokens=jnp.asarray([[4, 11, 6]]), features=jnp.ones((1, 3, 32)), count=jnp.asarray([3])
  )
  for d in (drafter, drafter.with_head(target)):
    _, (node_tokens, node_logp) = propose_lib.propose(
      d, target, d.empty_cache(1, 16), pairs, (jnp.asarray([[4, 11, 6]]), jnp.asarray([3])), pool
    )
    assert set(np.asarray(node_tokens)[:, 1:].ravel().tolist()) <= set(vocab)
    assert np.isfinite(np.asarray(node_logp)[:, 1:]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_plain_greedy_for_one_sequence(target, kind):
  tokens, lengths = testing.padded(testing.PROMPTS[2:3], width=9)
  cfg = decode.DecodeConfig(max_new_tokens=20, tree="sparse8")
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  spec = decode.generate(
    target, tokens, lengths, jax.random.key(0), cfg, testing.drafter_for(kind, target)
  )
  assert spec.tokens.tolist() == plain.tokens.tolist()


def test_eos_inside_an_accepted_path_cuts_the_round(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=30)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  # EOS = a token that pld's repetitive proposals accept mid-path in some sequence.
  eos = int(plain.tokens[0, 9])
  cfg = decode.DecodeConfig(max_new_tokens=30, eos_ids=(eos,), num_draft=6)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  spec = decode.generate(
    target, tokens, lengths, jax.random.key(0), cfg, testing.drafter_for("pld", target)
  )
  assert spec.tokens.tolist() == plain.tokens.tolist()
  stopped = plain.lengths < 30
  assert stopped.any() and (spec.tau[stopped] > 1).any()
  for row in np.nonzero(np.asarray(stopped))[0]:
    assert int(plain.tokens[row, plain.lengths[row] - 1]) == eos


def test_batch_of_one_equals_the_batch(target):
  # test_greedy_speculative_equals_plain_greedy_for_one_sequence's settings: its medusa program
  # is this batch-of-one program.
  cfg = decode.DecodeConfig(max_new_tokens=20, tree="sparse8")
  drafter = testing.drafter_for("medusa", target)
  batch = decode.generate(target, *testing.padded(testing.PROMPTS), jax.random.key(0), cfg, drafter)
  for row, prompt in enumerate(testing.PROMPTS):
    alone = decode.generate(target, *testing.padded([prompt], 9), jax.random.key(0), cfg, drafter)
    assert alone.tokens[0].tolist() == batch.tokens[row].tolist()


def oracle_proposer(reference_BW):
  """Proposes the target's own greedy continuation, read from a reference decode."""

  def propose(drafter, target, cache, pairs, context, pool):
    _, num_tokens = context
    index = num_tokens[:, None] + jnp.arange(pool.depth)
    candidates = jnp.take_along_axis(reference_BW, index, axis=1)[..., None]
    return cache, propose_lib._nodes_from_candidates(candidates, jnp.zeros_like(candidates), pool)

  return propose


ORACLE_ROUNDS, ORACLE_DRAFTS = 5, (1, 3, 5)


@pytest.fixture(scope="module")
def oracle_reference(target):
  """Plain greedy tokens of PROMPTS, enough for every K's rounds (one program for all K: the
  first n tokens of a longer greedy decode are the n-token decode)."""
  k = max(ORACLE_DRAFTS)
  cfg = decode.DecodeConfig(max_new_tokens=1 + ORACLE_ROUNDS * (k + 1) + k)
  return decode.generate(target, *testing.padded(testing.PROMPTS), jax.random.key(0), cfg).tokens


@pytest.mark.parametrize("num_draft", ORACLE_DRAFTS)
def test_oracle_drafter_reaches_tau_k_plus_one(target, oracle_reference, monkeypatch, num_draft):
  rounds = ORACLE_ROUNDS
  max_new = 1 + rounds * (num_draft + 1)
  tokens, lengths = testing.padded(testing.PROMPTS)
  reference = oracle_reference[:, : max_new + num_draft]
  full = np.zeros((len(testing.PROMPTS), 16 + max_new + 2 * num_draft), np.int32)
  for row, prompt in enumerate(testing.PROMPTS):
    full[row, : len(prompt)] = prompt
    full[row, len(prompt) : len(prompt) + reference.shape[1]] = reference[row]
  monkeypatch.setitem(propose_lib.PROPOSERS, "pld", oracle_proposer(jnp.asarray(full)))
  cfg = decode.DecodeConfig(max_new_tokens=max_new, num_draft=num_draft)
  out = decode.generate(
    target, tokens, lengths, jax.random.key(0), cfg, testing.drafter_for("pld", target)
  )
  assert out.tokens.tolist() == reference[:, :max_new].tolist()
  assert out.rounds.tolist() == [rounds] * len(testing.PROMPTS)
  np.testing.assert_array_equal(out.tau, num_draft + 1)
  np.testing.assert_array_equal(out.accepted_per_depth, rounds)


def test_stream_equals_generate_with_a_drafter(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  # The settings of test_greedy_speculative_equals_plain_greedy: its program for eagle is reused.
  cfg = decode.DecodeConfig(max_new_tokens=24, eos_ids=(3,), tree="dynamic:6")
  drafter = testing.drafter_for("eagle", target)
  out = decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter)
  pieces = [[] for _ in testing.PROMPTS]
  for new in decode.stream(target, tokens, lengths, jax.random.key(0), cfg, drafter):
    for row, ids in enumerate(new):
      pieces[row].extend(ids.tolist())
  for row in range(len(testing.PROMPTS)):
    assert pieces[row] == out.tokens[row, : out.lengths[row]].tolist()


def test_generate_under_a_users_jit(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=12, tree="sparse8")
  drafter = testing.drafter_for("pspec", target)
  fn = jax.jit(lambda t, d, x, n: decode.generate(t, x, n, jax.random.key(0), cfg, d).tokens)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  assert fn(target, drafter, tokens, lengths).tolist() == plain.tokens.tolist()


# --- sampling is lossless --------------------------------------------------------------------

NUM_SAMPLES = 30000


# Every drafter kind's draws from q on chains and trees, static and dynamic, with top-k / top-p,
# batch 1 and 4, are sampled_drafts_test's; here what else can change a round at T = 1: no
# drafter, prompt lookup, the lookup chain, a gate, an adaptive tree and the drafter options.
@pytest.mark.slow
@pytest.mark.parametrize(
  "kind,tree,options,batch",
  [
    (None, "", {}, 1),
    ("pld", "chain", {}, 1),
    ("pspec", "paths:0+lookup:3", {}, 1000),
    ("eagle", "sparse8+min:0.03+lookup:2", {}, 1000),  # depth-2 confidences spread around 0.03
    ("pspec", "adaptive:paths:0/1|chain+lookup:2|lookup:3", {}, 1000),
    # Fused target layers (and a deeper drafter with one shared mask vector).
    ("pspec", "sparse8", dict(feature_layers=(1, 0), num_layers=2, mask_input="shared"), 1000),
  ],
)
def test_speculative_sampling_matches_the_target_distribution(kind, tree, options, batch):
  target = testing.make_target(2.0, seed=3, cfg=testing.SAMPLING_TINY)
  prompt = [1, 2, 1, 2, 1]
  length = 4
  cfg = decode.DecodeConfig(
    max_new_tokens=length, sampling=SamplingConfig(temperature=1.0), num_draft=3, tree=tree
  )
  drafter = None
  if kind is not None:
    drafter = testing.drafter_for(kind, target, num_draft=3, seed=7, **options)
  samples, tau, _ = testing.sample_many(target, drafter, prompt, cfg, batch, NUM_SAMPLES)
  assert tau > 1.1 if drafter else tau == 1  # drafts do get accepted
  probs = testing.exact_joint(target, prompt, length)
  testing.assert_matches_joint(samples, probs, target.cfg.vocab_size, min_cells=20)


# --- the drafters ----------------------------------------------------------------------------


def reference_slot_mask(count, num_real, num_slots, start=0):
  """docs/design.md section 2, from positions: pair t sits at t; slot (a, d) at a + d."""
  anchor = start + count - 1
  kinds = [("real", start + j) for j in range(num_real)] + [
    ("slot", d) for d in range(1, num_slots + 1)
  ]
  mask = np.zeros((len(kinds),) * 2, bool)
  for i, (kind_i, x) in enumerate(kinds):
    for j, (kind_j, y) in enumerate(kinds):
      if kind_i == "real":
        mask[i, j] = kind_j == "real" and y <= x
      else:
        mask[i, j] = (y <= anchor) if kind_j == "real" else y <= x
  return mask


def test_slot_mask_follows_the_attention_rule():
  counts = jnp.asarray([1, 3, 5])
  mask = propose_lib.pspec_mask(counts, 5, 3)
  for row, count in enumerate([1, 3, 5]):
    ref = reference_slot_mask(count, 5, 3)
    # Rows of pad pairs (j >= count) are never read.
    keep = np.r_[np.arange(count), np.arange(5, 8)]
    np.testing.assert_array_equal(
      np.asarray(mask[row])[np.ix_(keep, keep)], ref[np.ix_(keep, keep)]
    )


def test_pspec_proposals_in_chunks_equal_one_pass_with_the_reference_mask(target):
  """The cached, chunked drafter == one uncached pass over all pairs and slots."""
  drafter = testing.drafter_for("pspec", target, num_draft=4)
  pool = tree_specs.parse("sparse8", 4)
  rng = np.random.default_rng(0)
  n = 11
  pair_tokens = rng.integers(0, 16, (1, n)).astype(np.int32)
  features = jnp.asarray(rng.normal(size=(1, n, 32)), jnp.float32)
  cache = drafter.empty_cache(1, 32)
  for lo, hi in [(0, 4), (4, 5), (5, 9), (9, 11)]:  # ragged chunks, testing.padded to 5 pairs
    width = 5
    chunk_tokens = np.zeros((1, width), np.int32)
    chunk_tokens[0, : hi - lo] = pair_tokens[0, lo:hi]
    chunk_features = jnp.zeros((1, width, 32)).at[:, : hi - lo].set(features[:, lo:hi])
    pairs = propose_lib.Pairs(
      tokens=jnp.asarray(chunk_tokens), features=chunk_features, count=jnp.asarray([hi - lo])
    )
    cache, (tokens, logp) = propose_lib.propose(drafter, target, cache, pairs, None, pool)
  # Reference: every pair and the 3 slots anchored at the last pair, explicit mask, no cache.
  fd = drafter_lib.FeatureDrafter
  u = drafter.apply(target.embed(jnp.asarray(pair_tokens)), features, method=fd.pairs)
  x = jnp.concatenate([u, drafter.apply(method=fd.slots)[None, :3]], axis=1)
  positions = jnp.concatenate([jnp.arange(n), n - 1 + jnp.arange(1, 4)])[None]
  empty = drafter.empty_cache(1, 1)
  mask = jnp.asarray(reference_slot_mask(n, n, 3))[None]
  g, _ = drafter.apply(x, positions, mask, empty)
  logp_ref = jax.nn.log_softmax(target.logits(g[:, n - 1 :]), axis=-1)
  a = pool.arrays
  expected_logp = logp_ref[0, a.depth[1:] - 1]
  expected_tokens = jnp.argsort(-expected_logp, axis=-1)[np.arange(7), a.rank[1:]]
  assert tokens[0, 1:].tolist() == expected_tokens.tolist()
  np.testing.assert_allclose(logp[0, 1:], expected_logp[np.arange(7), expected_tokens], atol=1e-5)


@pytest.mark.parametrize(
  ("kind", "options"), [("pspec", {}), ("eagle", {}), *OPTIONS[:2], OPTIONS[4], OPTIONS[5]]
)
def test_decoding_drafts_what_training_predicts(target, kind, options):
  """Each round's chain equals the teacher-forced training layout's top-1 at that anchor.

  The drafter at decode time (cached, chunked pairs, mask slots after the last one) and in
  training (`losses.distill_rows`' layout over the whole sequence) must be one function, or
  training would optimise something decoding never runs. eagle trains depth 1 only.
  """
  from pspec_jax import losses

  drafter = testing.drafter_for(kind, target, num_draft=4, **options)
  # Large weights, so that positions and attention move the drafter's top-1.
  drafter = drafter.replace(params=jax.tree.map(lambda x: 25 * x, drafter.params))
  cfg = decode.DecodeConfig(max_new_tokens=24, tree="chain")
  tokens, lengths = testing.padded(testing.PROMPTS[:1])
  plan = decode.make_plan(cfg, drafter, tokens.shape[1])
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  rounds = []
  while not bool(state.done.all()):
    rounds.append((int(state.cache.lengths[0]), np.asarray(state.node_tokens[0, 1:])))
    state = decode.round_step(plan, target, drafter, state)
  seq = state.tokens[:, : int(state.num_tokens[0])]
  segments = jnp.ones_like(seq)
  positions, mask = losses.segment_positions(segments), losses.segment_mask(segments)
  _, hidden, _ = drafter_lib.read_target(target, drafter.cfg, seq, positions, None, mask)
  layout = None
  if kind == "pspec":
    layout = losses.slot_layout(segments > 0, segments, 3, 0, jax.random.key(0))
  g_real, g_slots = drafter.apply(
    target.embed(losses.shifted(seq, 1)),
    hidden,
    positions,
    mask,
    layout,
    method=drafter_lib.FeatureDrafter.train_forward,
  )
  top = lambda g: np.asarray(jnp.argmax(drafter.logits(target, g[0]), -1))
  predicted = top(g_real)[:, None]  # pair a = (f_a, x_{a+1}) predicts x_{a+2}
  if layout is not None:
    (g_slots,) = g_slots  # one tier: every anchor keeps its K - 1 slots
    predicted = np.concatenate([predicted, top(g_slots)], axis=1)  # slot d: x_{a+d+2}
  assert len(rounds) > 5
  for n, drafted in rounds:  # the bonus is x_n: the last pair is a = n - 1
    np.testing.assert_array_equal(drafted[: predicted.shape[1]], predicted[n - 1])


def test_pld_proposes_the_continuation_of_the_longest_recent_match():
  tokens = jnp.asarray([[1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3, 0, 0]])
  # Suffix (2, 3) -> the most recent earlier "2 3" is at 5..6, followed by 4 5 7 2.
  out, ok, _ = propose_lib.pld_candidates(tokens, jnp.asarray([12]), 4, max_ngram=3)
  assert out.tolist() == [[4, 5, 7, 2]] and ok.tolist() == [[True] * 4]
  # Suffix "7 2 3" as a 3-gram never occurred before; "2 3" did -> the 2-gram wins.
  tokens = jnp.asarray([[1, 2, 3, 8, 6, 6, 7, 2, 3, 0]])
  out, ok, _ = propose_lib.pld_candidates(tokens, jnp.asarray([9]), 4, max_ngram=3)
  assert out[0, :4].tolist() == [8, 6, 6, 7] and ok.tolist() == [[True] * 4]
  # No match at all.
  out, ok, _ = propose_lib.pld_candidates(jnp.asarray([[4, 5, 6, 7]]), jnp.asarray([4]), 2, 2)
  assert ok.tolist() == [[False, False]]
  # A continuation that reaches the known tokens' end repeats the span it covered: 4 (5 4) 5 4.
  out, ok, _ = propose_lib.pld_candidates(jnp.asarray([[4, 5, 4, 0]]), jnp.asarray([3]), 3, 2)
  assert out.tolist() == [[5, 4, 5]] and ok.tolist() == [[True] * 3]
  out, ok, _ = propose_lib.pld_candidates(jnp.asarray([[7, 1, 1, 1, 0]]), jnp.asarray([4]), 4, 3)
  assert out.tolist() == [[1] * 4] and ok.tolist() == [[True] * 4]
  # min_ngram: a lone repeated token is no match when pairs are asked for.
  out, ok, _ = propose_lib.pld_candidates(jnp.asarray([[4, 5, 4, 0]]), jnp.asarray([3]), 3, 3, 2)
  assert ok.tolist() == [[False] * 3]


def test_pld_tells_how_far_back_its_match_runs():
  """The match length counts back from the suffix's end over the occurrence it took, at least
  the n-gram, at most `max_match`; 0 without a match."""
  line = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
  tokens = jnp.asarray([[3, *line, 99, 1, *line, 0, 0]])
  n = 3 + 2 * len(line)  # "... 12 13 14" again: the line matches 10 back (then 3 against 1)
  cases = [(n, 4, 4), (n, 16, 10), (n - 3, 16, 7)]
  for end, cap, want in cases:
    _, ok, match = propose_lib.pld_candidates(tokens, jnp.asarray([end]), 2, 3, max_match=cap)
    assert bool(ok[0, 0]) and match.tolist() == [want], (end, cap)
  _, ok, match = propose_lib.pld_candidates(jnp.asarray([[4, 5, 6, 7]]), jnp.asarray([4]), 2, 2)
  assert match.tolist() == [0] and not bool(ok[0, 0])
  # Two sequences: a 2-gram match ("4 5" once before, preceded by 1 against 2) and none.
  tokens = jnp.asarray([[1, 4, 5, 9, 2, 4, 5], [1, 2, 3, 4, 5, 6, 7]])
  _, _, match = propose_lib.pld_candidates(tokens, jnp.asarray([7, 7]), 2, 3)
  assert match.tolist() == [2, 0]


def test_bad_input_is_one_clear_error(target):
  tokens, lengths = testing.padded(testing.PROMPTS)
  pspec = testing.drafter_for("pspec", target, num_draft=3)
  with pytest.raises(ValueError, match="unknown tree 'bushy'"):
    decode.generate(
      target, tokens, lengths, jax.random.key(0), decode.DecodeConfig(tree="bushy"), pspec
    )
  with pytest.raises(ValueError, match="proposes at most K=3"):
    cfg = decode.DecodeConfig(num_draft=5)
    decode.generate(target, tokens, lengths, jax.random.key(0), cfg, pspec)
  with pytest.raises(ValueError, match="tree depth 3 = 35 does not fit the cache of 34"):
    cfg = decode.DecodeConfig(max_new_tokens=16, max_len=34)
    decode.generate(target, tokens, lengths, jax.random.key(0), cfg, pspec)
  other = testing.make_target(1.0, cfg=testing.TINY.replace(name="other", vocab_size=24))
  with pytest.raises(ValueError, match="built for target 'tiny'"):
    decode.generate(other, tokens, lengths, jax.random.key(0), decode.DecodeConfig(), pspec)


def test_generate_under_a_users_jit_with_batch_sharded_inputs(target):
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=12, tree="sparse8")
  drafter = testing.drafter_for("medusa", target)
  fn = jax.jit(lambda t, d, x, n: decode.generate(t, x, n, jax.random.key(0), cfg, d).tokens)
  sharded = fn(target, drafter, jax.device_put(tokens, rows), jax.device_put(lengths, rows))
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  assert sharded.tolist() == plain.tokens.tolist()


# --- prompt-lookup chains ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
  "tree", ["paths:0+lookup:4", "sparse8+lookup:2", "dynamic:6+lookup:3", "lookup:3"]
)
def test_lookup_chains_stay_lossless_and_are_accepted(target, kind, tree):
  drafter = testing.drafter_for(kind, target)
  cfg, _, spec = assert_greedy_lossless(target, drafter, tree)
  pool = decode.resolve_tree(cfg, drafter)
  assert spec.accepted_per_depth.shape == (len(testing.PROMPTS), pool.max_depth)
  if pool.lookup > pool.depth:  # only a lookup chain reaches below the drafted tree
    assert spec.accepted_per_depth[:, pool.depth :].sum() > 0


def test_a_round_without_a_lookup_match_verifies_the_drafted_tree_alone(target):
  # No pair of tokens repeats (the bonus follows 9, which occurs once): the drafted-only branch.
  tokens, lengths = testing.padded([[5, 6, 7, 8, 9]], width=8)
  drafter = testing.drafter_for("pspec", target).with_head(target)
  plan = _plan(decode.DecodeConfig(max_new_tokens=1, tree="paths:0+lookup:3"), drafter)
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  verified = decode.verify(plan, target, drafter, state)
  drafted = decode.verify(
    _plan(decode.DecodeConfig(tree="paths:0"), drafter), target, drafter, state
  )
  np.testing.assert_array_equal(verified.tree.children[0, 0], [-1, 1])  # chain cut at the root
  np.testing.assert_allclose(verified.logits[:, :2], drafted.logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(verified.logits[:, 2:], 0)  # the chain's nodes never ran
  # One repeated pair (8 9 ... 8 9) and the chain runs: its first node is what followed 8 9.
  tokens, lengths = testing.padded([[5, 8, 9, 4, 6, 8]], width=8)
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  state = state.replace(tokens=state.tokens.at[0, 6].set(9))  # the bonus completes "8 9"
  verified = decode.verify(plan, target, drafter, state)
  assert verified.node_tokens[0, 2:].tolist() == [4, 6, 8]
  np.testing.assert_array_equal(verified.tree.children[0, 0], [2, 1])
  assert np.abs(np.asarray(verified.logits[:, 2:])).sum() > 0


def test_a_round_whose_context_repeats_nowhere_is_a_round_of_the_drafted_tree(target):
  # No pair of tokens repeats: the round is the drafted tree's own (`rounds._round_lookup`),
  # which keeps what `paths:0` keeps and writes the same keys/values.
  tokens, lengths = testing.padded([[5, 6, 7, 8, 9]], width=8)
  drafter = testing.drafter_for("pspec", target)
  after = {}
  for tree in ("paths:0+lookup:3", "paths:0"):
    # One cache length for both: attention over another length rounds differently.
    plan = _plan(decode.DecodeConfig(max_new_tokens=8, max_len=32, tree=tree), drafter)
    state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
    after[tree] = decode.round_step(plan, target, drafter, state)
  chain, alone = after.values()
  assert chain.tokens.tolist() == alone.tokens.tolist()
  assert chain.cache.lengths.tolist() == alone.cache.lengths.tolist()
  n = int(alone.cache.lengths[0])
  for x, y in zip(jax.tree.leaves(chain.cache.k), jax.tree.leaves(alone.cache.k), strict=True):
    np.testing.assert_array_equal(x[..., :n, :, :], y[..., :n, :, :])


# --- gated trees -------------------------------------------------------------------------------


def gate_cuts(target, drafter, cfg):
  """Greedy decoding of PROMPTS round by round (`generate`'s rounds, stepped from the host).

  Returns its output and, per round, [B] masks of the active sequences, of those whose gate cut
  some of their drafted nodes, and of those whose gate cut all of them."""
  tokens, lengths = testing.padded(testing.PROMPTS)
  plan = decode.make_plan(cfg, drafter, tokens.shape[1])
  pool = plan.tree
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  rounds = []
  while not bool(state.done.all()):
    node_logp = state.node_logp
    if pool.budget:
      kept, tree = tree_lib.select_dynamic(pool, node_logp)
      node_logp = jnp.take_along_axis(node_logp, kept, axis=1)
    else:
      tree = tree_lib.batched(pool, node_logp.shape[0])
    links = np.asarray((tree.children >= 0).sum((1, 2)))
    gated = tree_lib.gated(tree, node_logp, pool.min_prob)
    left = np.asarray((gated.children >= 0).sum((1, 2)))
    active = ~np.asarray(state.done)
    rounds.append((active, active & (left < links), active & (left == 0)))
    state = decode.round_step(plan, target, drafter, state)
  return decode.finish(plan, state), rounds


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
@pytest.mark.parametrize(
  # These random drafters' depth-1 confidence spreads around 0.076: the first gate cuts some
  # sequences' drafts in a round, the second all of them in some rounds (the pass then runs
  # without the drafted nodes), the third none.
  "tree,cuts",
  [
    ("sparse8+min:0.076", "some"),
    ("paths:0/1/0.0+min:0.076+lookup:3", "all"),
    ("dynamic:6+min:0.0055", "none"),
  ],
)
def test_gated_trees_stay_lossless(target, kind, tree, cuts):
  # The rounds that `generate` loops over, stepped one at a time so that each round's gate can
  # be read: one compiled round, not a second whole decoding program.
  tokens, lengths = testing.padded(testing.PROMPTS)
  cfg = decode.DecodeConfig(max_new_tokens=24, eos_ids=(3,), tree=tree)
  plain = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  drafter = testing.drafter_for(kind, target).with_head(target)
  spec, rounds = gate_cuts(target, drafter, cfg)
  assert spec.tokens.tolist() == plain.tokens.tolist()
  assert spec.lengths.tolist() == plain.lengths.tolist()
  np.testing.assert_allclose(spec.tau * spec.rounds, spec.lengths - 1, rtol=1e-6)
  if cuts == "some":  # a round where some active sequences lose all their drafts, not all
    assert any(all_cut.any() and (all_cut != active).any() for active, _, all_cut in rounds)
  elif cuts == "all":  # a round where every active sequence loses all its drafts
    assert any((all_cut == active).all() for active, _, all_cut in rounds)
  else:
    assert not any(cut.any() for _, cut, _ in rounds)


def test_a_gated_round_leaves_unlikely_drafts_out_of_the_pass(target):
  # No pair of tokens repeats, so no lookup chain: only the gate decides.
  tokens, lengths = testing.padded([[5, 6, 7, 8, 9]], width=8)
  drafter = testing.drafter_for("pspec", target).with_head(target)
  plan = _plan(
    decode.DecodeConfig(max_new_tokens=1, tree="paths:0/1/0.0+min:0.3+lookup:3"), drafter
  )
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  ungated_plan = _plan(decode.DecodeConfig(tree="paths:0/1/0.0"), drafter)
  ungated = decode.verify(ungated_plan, target, drafter, state)
  # Nodes (0,), (1,), (0, 0): confidences 0.6, 0.2 and 0.6 * 0.4 = 0.24; the gate keeps (0,).
  sure = state.replace(node_logp=jnp.log(jnp.asarray([[1.0, 0.6, 0.2, 0.4]])))
  verified = decode.verify(plan, target, drafter, sure)
  np.testing.assert_array_equal(verified.tree.children[0, 0], [-1, 1, -1])  # no chain, no (1,)
  np.testing.assert_array_equal(verified.tree.children[0, 1], [-1, -1, -1])  # no (0, 0)
  np.testing.assert_allclose(verified.logits[:, :4], ungated.logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(verified.logits[:, 4:], 0)  # the chain's nodes never ran
  # Every draft below 0.3: the pass runs the root alone, and the round keeps one token.
  unsure = state.replace(node_logp=jnp.log(jnp.asarray([[1.0, 0.25, 0.2, 0.9]])))
  verified = decode.verify(plan, target, drafter, unsure)
  assert (np.asarray(verified.tree.children[0, 0]) == -1).all()
  np.testing.assert_allclose(verified.logits[:, 0], ungated.logits[:, 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(verified.logits[:, 1:], 0)
  _, num_accepted, _ = decode.accept_path(plan, unsure, verified)
  assert num_accepted.tolist() == [0]


@pytest.mark.parametrize("kind", ["pspec", "eagle"])
def test_the_drafter_takes_in_the_valid_pairs_alone(target, kind):
  """A round's pairs are as wide as the plan's deepest path; the drafter runs over the fewest
  leading ones (1, 2, 4, ... or all) that hold every sequence's valid pairs, and drafts and
  caches what it would over all of them."""
  from pspec_jax import rounds

  drafter = testing.drafter_for(kind, target).with_head(target)
  tokens, lengths = testing.padded([[5, 6, 7, 8, 9], [3, 1, 4]], width=8)
  plan = _plan(decode.DecodeConfig(max_new_tokens=4, tree="paths:0/1/0.0+lookup:6"), drafter)
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  width = plan.max_depth + 1
  assert width == 7
  keys = jax.random.split(jax.random.key(1), 2)
  pairs = propose_lib.Pairs(
    tokens=jax.random.randint(keys[0], (2, width), 0, target.cfg.vocab_size),
    features=jax.random.normal(keys[1], (2, width, target.cfg.hidden_size)),
    count=jnp.asarray([1, 3]),
  )
  context = (state.tokens, state.num_tokens)

  def run(p):
    cache, nodes = propose_lib.propose(drafter, target, state.drafter_cache, p, context, plan.tree)
    return cache, nodes, p.tokens.shape[1]

  narrowed = rounds._over_valid_pairs(plan, state, pairs, run)
  whole = run(pairs)
  assert int(narrowed[2]) == 4  # the branch that ran: 3 valid pairs at most
  for a, b in zip(jax.tree.leaves(narrowed[1]), jax.tree.leaves(whole[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  cache, full = narrowed[0], whole[0]
  np.testing.assert_array_equal(cache.lengths, full.lengths)
  for b, start in enumerate(np.asarray(state.drafter_cache.lengths)):
    written = slice(start, int(full.lengths[b]))  # the valid pairs' keys/values
    for x, y in ((cache.k, full.k), (cache.v, full.v)):
      for xl, yl in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(xl[..., b, written, :, :], yl[..., b, written, :, :], atol=1e-5)
  one = pairs.replace(count=jnp.asarray([1, 1]))
  assert int(rounds._over_valid_pairs(plan, state, one, run)[2]) == 1
  # Pairs wider than a pending buffer (the prompt's) go in whole.
  wide = pairs.replace(
    tokens=jnp.tile(pairs.tokens, (1, 3)), features=jnp.tile(pairs.features, (1, 3, 1))
  )
  assert int(rounds._over_valid_pairs(plan, state, wide, run)[2]) == 3 * width


def _plan(cfg, drafter, width=8):
  return decode.make_plan(cfg, drafter, width)


@pytest.mark.parametrize("weights", ["panels", "blocks"])
def test_a_tree_node_computes_a_plain_steps_logits_bit_for_bit(weights):
  # Greedy speculation is lossless only if a node's logits are the plain step's bits whatever
  # rows share its pass: near-ties are rare with float32 products, but 8-bit activations turn a
  # last-bit difference into another greedy token. (XLA's mean over SmolLM2's 576 features
  # changed from 8 rows on.)
  target = checkpoints.load_target(
    "smollm2-135m-instruct", weight_layout="decode", gguf_blocks=weights == "blocks"
  )
  assert target.keeps_blocks == (weights == "blocks" and cpu_kernel.available())
  prompt = jnp.asarray([np.arange(70) % 129], jnp.int32)  # a prefill past the kernel's 64 rows
  _, kv = target(prompt, jnp.arange(70)[None])
  cache = target.empty_cache(batch=1, max_len=128).write(kv, jnp.array([70]))
  run = jax.jit(lambda target, cache, *nodes: target.logits(target(*nodes[:2], cache, nodes[2])[0]))
  step = functools.partial(run, target, cache)
  plain = np.asarray(step(jnp.asarray([[7]]), jnp.asarray([[70]]), jnp.ones((1, 1, 1), bool)))
  rng = np.random.default_rng(0)
  for t in (2, 9, 33):  # one row beside it, past 8 rows (where XLA:CPU reordered), past 32
    others = rng.integers(0, 129, t - 1)
    nodes = jnp.asarray([[7, *others]], jnp.int32)
    positions = jnp.asarray([[70, *rng.integers(70, 75, t - 1)]], jnp.int32)
    mask = np.tril(rng.random((t, t)) < 0.5) | np.eye(t, dtype=bool)
    mask[:, 0] = True  # every node descends from the root, which sees only itself
    mask[0, 1:] = False
    got = np.asarray(step(nodes, positions, jnp.asarray(mask)[None]))
    np.testing.assert_array_equal(got[:, :1].view(np.uint32), plain.view(np.uint32), str(t))
