"""The target cache: ragged writes, and compaction of accepted tree paths into contiguous slots.

References are slow and independent: a numpy loop for `KVCache.write`, one uncached target (or
drafter) pass over each finished sequence for the caches a whole decode leaves behind, and a
numpy gather along a hand-chosen path for `decode.commit`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import decode, testing, tree_specs
from pspec_jax import drafter as drafter_lib
from pspec_jax import tree as tree_lib
from pspec_jax.kv_cache import KVCache

# --- KVCache.write ---------------------------------------------------------------------------


def reference_write(k, v, lengths, k_new, v_new, advance):
  """The documented semantics, one sequence at a time: all T entries go to lengths[b] on."""
  k, v, lengths = k.copy(), v.copy(), lengths.copy()
  t = k_new.shape[2]
  for b in range(k.shape[1]):
    k[:, b, lengths[b] : lengths[b] + t] = k_new[:, b]
    v[:, b, lengths[b] : lengths[b] + t] = v_new[:, b]
  return k, v, lengths + advance


def stacked(cache):
  """Keys and values [L, B, S, K, H] of either layout, as numpy."""
  return tuple(np.asarray(x) for x in cache.stacked())


@pytest.mark.parametrize("per_layer", [True, False])
def test_write_with_ragged_lengths_and_advances_matches_a_loop(per_layer):
  rng = np.random.default_rng(0)
  shape = (2, 4, 12, 2, 3)  # L, B, S, K, H
  k = rng.normal(size=shape).astype(np.float32)
  v = rng.normal(size=shape).astype(np.float32)
  layout = tuple if per_layer else jnp.asarray
  cache = KVCache(
    k=layout(jnp.asarray(k)), v=layout(jnp.asarray(v)), lengths=jnp.asarray([0, 3, 7, 1], jnp.int32)
  )
  assert cache.per_layer == per_layer and cache.max_len == 12
  lengths = np.asarray(cache.lengths)
  write = jax.jit(lambda c, kv, a: c.write(kv, a))
  # Advances of 0 (an idle sequence), partial and full; T changes between writes.
  for t, advance in [(3, [3, 1, 0, 2]), (2, [0, 2, 1, 2]), (4, [4, 0, 1, 3])]:
    k_new = rng.normal(size=(2, 4, t, 2, 3)).astype(np.float32)
    v_new = rng.normal(size=(2, 4, t, 2, 3)).astype(np.float32)
    advance = np.asarray(advance, np.int32)
    cache = write(cache, (jnp.asarray(k_new), jnp.asarray(v_new)), jnp.asarray(advance))
    k, v, lengths = reference_write(k, v, lengths, k_new, v_new, advance)
    np.testing.assert_array_equal(stacked(cache)[0], k)
    np.testing.assert_array_equal(stacked(cache)[1], v)
    np.testing.assert_array_equal(cache.lengths, lengths)
  assert lengths.tolist() == [7, 6, 9, 8]


def test_write_casts_to_the_cache_dtype():
  cache = KVCache.zeros(
    num_layers=1, batch=2, max_len=4, num_kv_heads=1, head_dim=2, dtype=jnp.bfloat16
  )
  new = jnp.full((1, 2, 1, 1, 2), 1.0 / 3.0, jnp.float32)
  cache = cache.write((new, new), jnp.asarray([1, 0]))
  (k,) = cache.k  # one buffer per layer
  assert k.dtype == jnp.bfloat16
  assert float(k[1, 0, 0, 0]) == float(jnp.bfloat16(1.0 / 3.0))
  assert cache.lengths.tolist() == [1, 0]


# --- compaction after a whole decode ---------------------------------------------------------

# EOS 4 ends the last prompt's sequence mid-way (its greedy text contains a 4), so one row stops
# on an EOS inside an accepted path while the others run to their budget.
DECODE_CFG = decode.DecodeConfig(max_new_tokens=24, eos_ids=(4,), tree="sparse8")


def run_to_completion(target, drafter, tokens, lengths, cfg):
  plan = decode.make_plan(cfg, drafter, tokens.shape[1])
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  while not bool(state.done.all()):
    state = decode.round_step(plan, target, drafter, state)
  return state


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


@pytest.fixture(scope="module")
def final_states(target):
  """Final decode states, computed once per drafter kind (None: plain decoding)."""
  states = {}

  def get(kind):
    if kind not in states:
      drafter = None
      if kind == "medusa":
        drafter = drafter_lib.random_drafter("medusa", target, jax.random.key(1), num_draft=4)
      elif kind == "pspec":
        # Scaled up, this random pspec drafter gets some paths accepted on this target.
        drafter = drafter_lib.random_drafter("pspec", target, jax.random.key(3), num_draft=4)
        drafter = drafter.replace(params=jax.tree.map(lambda x: 10.0 * x, drafter.params))
      state = run_to_completion(target, drafter, *testing.padded(testing.PROMPTS), DECODE_CFG)
      states[kind] = (jax.device_get(state), drafter)
    return states[kind]

  return get


def tau(state):
  return (np.asarray(state.num_generated) - 1) / np.maximum(np.asarray(state.rounds), 1)


@pytest.mark.parametrize("kind", ["medusa", "pspec"])
def test_speculative_cache_equals_plain_decoding_cache(final_states, kind):
  plain, _ = final_states(None)
  spec, _ = final_states(kind)
  assert (tau(spec) > 1.5).any(), tau(spec)  # multi-token paths were compacted
  assert (np.asarray(spec.num_generated) < DECODE_CFG.max_new_tokens).any()  # an EOS stop
  lengths = np.asarray(spec.cache.lengths)
  np.testing.assert_array_equal(lengths, plain.cache.lengths)
  for b, n in enumerate(lengths):
    # Bonus included: the token after the cached ones is known too.
    np.testing.assert_array_equal(spec.tokens[b, : n + 1], plain.tokens[b, : n + 1])
    # Different pass shapes (tree of 8 vs one token) round differently: close, not bit-equal.
    for got, want in zip(stacked(spec.cache), stacked(plain.cache), strict=True):
      np.testing.assert_allclose(got[:, b, :n], want[:, b, :n], atol=1e-4)


def known_tokens(state):
  """[B, W] every sequence's tokens x_1..x_{n+1} (the bonus last), zeros after; and n."""
  lengths = np.asarray(state.cache.lengths)
  index = np.arange(state.tokens.shape[1])[None, :]
  return jnp.asarray(np.where(index <= lengths[:, None], state.tokens, 0)), lengths


@pytest.mark.parametrize("kind", [None, "medusa", "pspec"])
def test_cache_equals_one_uncached_forward_of_the_final_sequence(target, final_states, kind):
  state, _ = final_states(kind)
  tokens, lengths = known_tokens(state)
  # Causal, so the zeros after a sequence never reach its own positions.
  _, (k, v) = target(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
  for b, n in enumerate(lengths):
    for got, want in zip(stacked(state.cache), (k, v), strict=True):
      np.testing.assert_allclose(got[:, b, :n], want[:, b, :n], atol=1e-4)


def test_drafter_cache_equals_one_pass_over_all_pairs(target, final_states):
  """The pspec drafter's cache holds pair t = (f_t, x_{t+1}) at slot t, for every cached t."""
  state, drafter = final_states("pspec")
  np.testing.assert_array_equal(state.drafter_cache.lengths, state.cache.lengths)
  tokens, lengths = known_tokens(state)
  width = tokens.shape[1] - 1
  positions = jnp.broadcast_to(jnp.arange(width), (len(lengths), width))
  features, _ = target(tokens[:, :-1], positions)
  fd = drafter_lib.FeatureDrafter
  u = drafter.apply(target.embed(tokens[:, 1:]), features, method=fd.pairs)
  causal = jnp.tril(jnp.ones((width, width), jnp.bool_))[None]
  _, (k, v) = drafter.apply(u, positions, causal, drafter.empty_cache(len(lengths), 1))
  for b, n in enumerate(lengths):
    for got, want in zip(stacked(state.drafter_cache), (k, v), strict=True):
      np.testing.assert_allclose(got[:, b, :n], want[:, b, :n], atol=1e-4)


# --- decode.commit on a hand-built round -----------------------------------------------------

COMMIT_TREE = "sparse8"  # K=3: nodes (), (0,), (1,), (2,), (0,0), (0,1), (1,0), (0,0,0)
# The node paths (root first) that greedy acceptance takes in each row; row 3 is already done.
PATHS = [[0, 1, 4, 7], [0, 2, 6], [0], [0, 3]]
N = [6, 5, 4, 7]  # cache lengths before the round
PROMPT_LENGTHS = [3, 4, 2, 5]  # so [4, 2, 3, 3] tokens are generated before the round
V, L, KH, H, D, WIDTH = 16, 2, 2, 4, 8, 16


def node_token(b, m):
  return (3 * b + m + 1) % V  # distinct within a row, nodes 0..7


def bonus_token(b):
  return node_token(b, 9)  # no node of the row carries it


def commit_inputs():
  rng = np.random.default_rng(0)
  tree = tree_specs.parse(COMMIT_TREE, 3)
  m = tree.num_nodes
  batch = len(PATHS)
  node_tokens = np.array([[node_token(b, i) for i in range(m)] for b in range(batch)], np.int32)
  # Greedy: the argmax at every path node is the next path node's token, the bonus at its end.
  argmax = np.array([[bonus_token(b)] * m for b in range(batch)])
  for b, path in enumerate(PATHS):
    for parent, child in zip(path, path[1:], strict=False):
      argmax[b, parent] = node_tokens[b, child]
  logits = rng.normal(size=(batch, m, V)) + 10.0 * np.eye(V)[argmax]
  tokens = rng.integers(0, V, (batch, WIDTH)).astype(np.int32)
  tokens[np.arange(batch), N] = node_tokens[:, 0]  # the root is the bonus token x_{n+1}
  shape = (L, batch, WIDTH, KH, H)
  state = decode.DecodeState(
    cache=KVCache(
      k=jnp.asarray(rng.normal(size=shape), jnp.float32),
      v=jnp.asarray(rng.normal(size=shape), jnp.float32),
      lengths=jnp.asarray(N, jnp.int32),
    ),
    tokens=jnp.asarray(tokens),
    prompt_lengths=jnp.asarray(PROMPT_LENGTHS, jnp.int32),
    done=jnp.asarray([False, False, False, True]),
    rounds=jnp.asarray([2, 1, 1, 2], jnp.int32),
    accepted=jnp.zeros((batch, tree.depth), jnp.int32),
    key=jax.random.key(0),
    step=jnp.asarray(3, jnp.int32),
    drafter_cache=None,
    node_tokens=jnp.zeros((batch, m), jnp.int32),
    node_logp=jnp.zeros((batch, m), jnp.float32),
    draft_logq=jnp.zeros((batch, 1, 1), jnp.float32),
  )
  kv_shape = (L, batch, m, KH, H)
  verified = decode.Verified(
    tree=tree_lib.batched(tree, batch),
    node_tokens=jnp.asarray(node_tokens),
    features=jnp.asarray(rng.normal(size=(batch, m, D)), jnp.float32),
    kv=(
      jnp.asarray(rng.normal(size=kv_shape), jnp.float32),
      jnp.asarray(rng.normal(size=kv_shape), jnp.float32),
    ),
    logits=jnp.asarray(logits, jnp.float32),
  )
  return state, verified


@pytest.mark.parametrize(
  "max_new_tokens,eos_ids,kept,done",
  [
    # Whole paths: accepted drafts + the bonus.
    (20, (), [4, 3, 1, 0], [False, False, False, True]),
    # Budgets [2, 4, 3, 3]: row 0 is cut to 2 tokens and finishes; the others fit.
    (6, (), [2, 3, 1, 0], [True, False, False, True]),
    # EOS: row 0's second draft (node 4) and row 2's bonus; tokens after an EOS are dropped.
    (20, (node_token(0, 4), bonus_token(2)), [2, 3, 1, 0], [True, False, True, True]),
  ],
)
def test_commit_copies_the_accepted_path_into_contiguous_slots(max_new_tokens, eos_ids, kept, done):
  state, verified = commit_inputs()
  # The drafter only names the tree here; commit never calls it.
  pld = drafter_lib.DrafterConfig.for_target("pld", testing.TINY, num_draft=3, tree=COMMIT_TREE)
  cfg = decode.DecodeConfig(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
  new_state, pairs = decode.commit(
    decode.make_plan(cfg, drafter_lib.Drafter(cfg=pld, params={}), WIDTH), state, verified
  )
  assert new_state.cache.lengths.tolist() == [n + k for n, k in zip(N, kept, strict=True)]
  assert new_state.done.tolist() == done
  assert new_state.rounds.tolist() == [3, 2, 2, 2]  # finished rows do not count rounds
  assert pairs.count.tolist() == kept
  k_in, v_in = np.asarray(state.cache.k), np.asarray(state.cache.v)
  k_nodes, v_nodes = np.asarray(verified.kv[0]), np.asarray(verified.kv[1])
  for b, (path, n, keep) in enumerate(zip(PATHS, N, kept, strict=True)):
    # Reference: the earlier slots as they were, then the path nodes' kv gathered in order.
    k_ref = np.concatenate([k_in[:, b, :n], k_nodes[:, b, path[:keep]]], axis=1)
    v_ref = np.concatenate([v_in[:, b, :n], v_nodes[:, b, path[:keep]]], axis=1)
    np.testing.assert_array_equal(new_state.cache.k[:, b, : n + keep], k_ref)
    np.testing.assert_array_equal(new_state.cache.v[:, b, : n + keep], v_ref)
    # Tokens x_{n+2}..: the drafts below the root, then the bonus, cut to `keep`.
    new = [node_token(b, i) for i in path[1:]] + [bonus_token(b)]
    tokens_ref = np.array(state.tokens[b])
    tokens_ref[n + 1 : n + 1 + keep] = new[:keep]
    assert new_state.tokens[b].tolist() == tokens_ref.tolist()
    assert pairs.tokens[b, :keep].tolist() == new[:keep]
    np.testing.assert_array_equal(pairs.features[b, :keep], verified.features[b, path[:keep]])
    # A round that kept `keep` tokens accepted drafts at depths 1..keep-1.
    assert new_state.accepted[b].tolist() == [int(d < keep - 1) for d in range(3)]
