"""Acceptance of a verified token tree (docs/design.md section 3.5).

One walk serves greedy decoding and sampling. Starting at the root, the children of the current
node are tried in rank order:

- sampling (T > 0), lossless multi-child rejection sampling for deterministic children: with
  r the target's (filtered) distribution at the current node, child x is accepted with
  probability r(x) / sum(r); on rejection r(x) is set to 0 (the residual renormalises itself
  through the sum). If every child is rejected the walk stops and the bonus token is sampled
  from what is left of r. The emitted tokens therefore follow the target's distribution
  exactly, whatever the drafter proposed: each step is sampling without replacement until a
  sample lands on a proposed child.
- greedy (T = 0): r is the one-hot of the target's argmax, so a child is accepted iff it is
  the argmax, and the bonus is the argmax at the last accepted node: the same tokens as plain
  greedy decoding. This case runs in that reduced form, on token ids alone: the walk over
  vocabulary-sized distributions costs a round a millisecond on a CPU.

- sampling with drafts drawn from the drafter's distribution q (`sampled_walk`): standard
  speculative sampling on a chain (Leviathan et al.; Chen et al.) and recursive rejection
  sampling on a tree (Recursive Speculative Decoding, Jeon et al.). A node's drafted children
  were drawn from q without replacement (Gumbel-top-k), and are tried in the order drawn: with
  r the current residual and pi the proposal the child x was drawn from (q renormalised over the
  siblings not yet tried), x is accepted with probability min(1, r(x) / pi(x)); on rejection
  r becomes norm(max(0, r - pi)). Each step is a speculative-sampling step of r with proposal
  pi, so the emitted token follows r, and by induction the node's target distribution.
  Prompt-lookup children have no q: their proposal is the point mass on their token, for which
  the same step is the deterministic rule above (accept with r(x), then zero r(x)). On a CPU
  with the kernels, each level of this walk is one kernel call (`rejection_levels`).

The last accepted node's residual gives the bonus token; tau = accepted + 1.
"""

import functools

import jax
import jax.numpy as jnp

from pspec_jax import cpu_kernel, sampling
from pspec_jax.sampling import SamplingConfig, argmax, filtered_logits
from pspec_jax.tree import TreeArrays

__all__ = ["accept", "bonus_noise"]


def accept(
  logits_BMV: jax.Array,
  node_tokens_BM: jax.Array,
  tree: TreeArrays,
  max_depth: int,
  key: jax.Array,
  cfg: SamplingConfig,
  drafts: tuple[jax.Array, jax.Array] | None = None,
  noise_BV: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Walks every sequence's tree from the root.

  Args:
    logits_BMV: target logits at every node (float32).
    node_tokens_BM: every node's token; node 0 is the root.
    tree: the verified tree, with a batch axis.
    max_depth: static bound on the tree depth (P).
    key: PRNG key for this round; unused when greedy.
    cfg: sampling settings, the same as plain decoding's.
    drafts: (node_table_BM, draft_logq_BGV) when the drafted nodes were drawn from the
      drafter's distributions (`sampled_walk`), else None (deterministic children). Ignored
      when greedy.
    noise_BV: the bonus draw's random numbers if drawn already (`bonus_noise(key, ...)`, the
      same numbers), else None. Ignored when greedy.

  Returns:
    (path_BP1, num_accepted_B, bonus_B): node indices from the root down the accepted path
    (entries past `num_accepted + 1` repeat the last accepted node), the accepted draft tokens
    per sequence, and the next bonus token.
  """
  if cfg.greedy:
    best_BM = argmax(logits_BMV)
    walk = functools.partial(greedy_walk, max_depth=max_depth)
    path_BP1 = jax.vmap(walk)(best_BM, node_tokens_BM, tree.children)
    last = path_BP1[:, -1:]
    bonus = jnp.take_along_axis(best_BM, last, axis=1)[:, 0]
  elif drafts is None:
    path_BP1, bonus = sampling_walk(logits_BMV, node_tokens_BM, tree, max_depth, key, cfg, noise_BV)
  else:
    path_BP1, bonus = sampled_walk(
      logits_BMV, node_tokens_BM, tree, *drafts, max_depth, key, cfg, noise_BV
    )
  num_accepted = jnp.take_along_axis(tree.depth, path_BP1[:, -1:], axis=1)[:, 0]
  return path_BP1, num_accepted.astype(jnp.int32), bonus.astype(jnp.int32)


def bonus_noise(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """The random numbers of the bonus token's draw that `accept` makes with `key`, for logits of
  `shape` [B, V] (`sampling.noise`).

  An adaptive round draws them before the switch over its candidates: JAX lowers threefry on a
  CPU as a loop of 5 steps, which XLA:CPU runs as one cheap kernel at the top of the round but
  step by step, copying the bits, inside a `lax.switch` branch (Gumbel noise of a 49k-token
  vocabulary: 0.5 ms against 0.04 ms, 2% of a round of the embedded target)."""
  return sampling.noise(jax.random.split(key)[1], shape)


def _bonus(key: jax.Array, logits_BV: jax.Array, noise_BV: jax.Array | None) -> jax.Array:
  """The bonus token: a draw from float32 `logits_BV` with `bonus_noise(key)`, or with
  `noise_BV` if drawn already."""
  if noise_BV is None:
    noise_BV = bonus_noise(key, logits_BV.shape)
  return sampling.categorical(key, logits_BV, noise_BV)


def greedy_walk(best_M, tokens_M, children_MC, max_depth: int) -> jax.Array:
  """The accepted path [P+1] of one sequence when greedy: at each level the first child (in rank
  order) whose token is the target's choice `best_M` at the current node. A level that accepts
  nothing leaves the node, and so every later level, where it is."""
  path = jnp.zeros((max_depth + 1,), jnp.int32)

  def level(d, carry):
    node, path = carry
    kids = children_MC[node]
    hit = (kids >= 0) & (tokens_M[jnp.maximum(kids, 0)] == best_M[node])
    node = jnp.where(hit.any(), kids[jnp.argmax(hit)], node)
    return node, path.at[d + 1].set(node)

  return jax.lax.fori_loop(0, max_depth, level, (jnp.int32(0), path))[1]


def _levels(level, carry, max_depth: int):
  """Runs `level(carry) -> (carry, moved)` from the root down while a level accepts a child
  (at most `max_depth` levels); carry[0] is the level's depth. Vocabulary-sized work is done per
  level reached, not per tree node: a round that accepts a nodes filters a + 1 rows."""
  if not max_depth:  # the root alone: plain decoding
    return carry

  def body(state):
    carry, _ = state
    carry, moved = level(carry)
    return carry, moved

  def more(state):
    carry, moved = state
    return moved & (carry[0] < max_depth)

  return jax.lax.while_loop(more, body, (carry, jnp.bool_(True)))[0]


def _filled_path(path_P1, node, last_depth):
  """Levels below the last accepted node (at `last_depth`) repeat it."""
  return jnp.where(jnp.arange(path_P1.shape[0]) > last_depth, node, path_P1)


def sampling_walk(logits_BMV, node_tokens_BM, tree, max_depth, key, cfg, noise_BV=None):
  """(path_BP1, bonus_B) by multi-child rejection sampling (the module docstring).

  The residual r is never written out: it is the current node's distribution with this
  level's rejected tokens set to 0, so the walk carries those tokens and their mass (sum(r) =
  1 - that mass), reads single probabilities from the node's filtered logits and their
  logsumexp, and samples the bonus from the last node's logits with the rejected tokens masked.
  Only the rows of nodes the walk reaches are filtered.
  """
  batch = logits_BMV.shape[0]
  num_slots = tree.children.shape[-1]
  walk_key = jax.random.split(key)[0]  # [1] is the bonus draw's (`bonus_noise`)
  uniform_BPC = jax.random.uniform(walk_key, (batch, max_depth, num_slots))

  def walk(logits_MV, tokens_M, children_MC, uniform_PC):
    row = lambda node: filtered_logits(logits_MV[node], cfg)

    def level(carry):
      depth, node, logits_V, _, path = carry
      lse = jax.nn.logsumexp(logits_V)

      def slot(c, inner):
        child, rejected, rejected_mass = inner
        kid = children_MC[node, c]
        tried = (child < 0) & (kid >= 0)
        token = tokens_M[jnp.maximum(kid, 0)]
        fresh = ~jnp.any(rejected == token)  # a rejected token has no mass left
        mass = jnp.where(fresh, jnp.exp(logits_V[token] - lse), 0.0)
        # mass > 0: rounding may leave 1 - rejected_mass a few ulps off the exact remainder.
        accepted = tried & (mass > 0) & (uniform_PC[depth, c] * (1.0 - rejected_mass) < mass)
        now_rejected = tried & ~accepted
        rejected = rejected.at[c].set(jnp.where(now_rejected, token, rejected[c]))
        rejected_mass = rejected_mass + jnp.where(now_rejected, mass, 0.0)
        return jnp.where(accepted, kid, child), rejected, rejected_mass

      start = (jnp.int32(-1), jnp.full((num_slots,), -1, jnp.int32), jnp.float32(0.0))
      child, rejected, _ = jax.lax.fori_loop(0, num_slots, slot, start)
      moved = child >= 0
      node = jnp.where(moved, child, node)
      path = path.at[depth + 1].set(node)
      # A new node: its own distribution and a fresh residual.
      logits_V = jnp.where(moved, row(node), logits_V)
      rejected = jnp.where(moved, -1, rejected)
      return (depth + moved, node, logits_V, rejected, path), moved

    carry = (
      jnp.int32(0),
      jnp.int32(0),
      row(0),
      jnp.full((num_slots,), -1, jnp.int32),
      jnp.zeros((max_depth + 1,), jnp.int32),
    )
    depth, node, logits_V, rejected, path = _levels(level, carry, max_depth)
    residual = logits_V.at[jnp.maximum(rejected, 0)].min(
      jnp.where(rejected >= 0, -jnp.inf, jnp.inf)
    )
    # In exact arithmetic the last child holding all the remaining mass is always accepted;
    # if rounding rejected it, nothing is left: draw from the node's distribution instead.
    residual = jnp.where(jnp.isfinite(residual).any(), residual, logits_V)
    return _filled_path(path, node, depth), residual

  path_BP1, residual_BV = jax.vmap(walk)(logits_BMV, node_tokens_BM, tree.children, uniform_BPC)
  return path_BP1, _bonus(key, residual_BV, noise_BV)


def sampled_walk(
  logits_BMV,
  node_tokens_BM,
  tree,
  node_table_BM,
  draft_logq_BGV,
  max_depth,
  key,
  cfg,
  noise_BV=None,
):
  """(path_BP1, bonus_B) by recursive rejection sampling (the module docstring).

  Args:
    logits_BMV, node_tokens_BM, tree, max_depth, key, cfg, noise_BV: as `accept`'s.
    node_table_BM: the row of `draft_logq_BGV` each node was drawn from; -1 for nodes with no
      distribution (the root, prompt-lookup nodes), which are tried as point masses.
    draft_logq_BGV: the drafter's (filtered) log-distributions the drafted nodes were drawn
      from, over the target's vocabulary. A node's drafted children come from one row, in the
      order drawn (rank order), without replacement.

  Unlike `sampling_walk`, the residual is a vocabulary-sized vector: r - pi has no short form.
  """
  batch = logits_BMV.shape[0]
  walk_key = jax.random.split(key)[0]  # [1] is the bonus draw's (`bonus_noise`)
  uniform_BPC = jax.random.uniform(walk_key, (batch, max_depth, tree.children.shape[-1]))
  args = (
    logits_BMV,
    draft_logq_BGV,
    node_tokens_BM,
    node_table_BM,
    tree.children,
    tree.depth,
    uniform_BPC,
  )
  if sampling.uses_cpu_kernel():
    if noise_BV is None:
      noise_BV = bonus_noise(key, logits_BMV[:, 0].shape)
    return rejection_levels(*args, noise_BV[:, 0], cfg)
  path_BP1, log_residual_BV = recursive_rejection(*args, cfg)
  return path_BP1, _bonus(key, log_residual_BV, noise_BV)


def _kid_tables(children_MC, table_M):
  """[M] the row of q each node's drafted children were drawn from (0 where none: never read)."""
  return jnp.max(jnp.where(children_MC >= 0, table_M[children_MC], -1), axis=-1)


def rejection_levels(
  logits_BMV,
  logq_BGV,
  node_tokens_BM,
  node_table_BM,
  children_BMC,
  depth_BM,
  uniform_BPC,
  bits_B2,
  cfg,
):
  """`recursive_rejection` on the CPU kernels, with the bonus draw's random bits (`noise`):
  (path_BP1, bonus_B). Each level reached is one kernel call (`cpu_kernel.rejection`) that tries
  the node's children and, where it accepts none, draws the bonus token from what is left of
  the residual; the residual never leaves the kernel. The same walk and law as
  `recursive_rejection`'s, whose vocabulary-sized steps cost XLA:CPU about 0.4 ms a round."""
  max_depth, num_slots = uniform_BPC.shape[1:]

  def walk(logits_MV, logq_GV, tokens_M, table_M, children_MC, depth_M, uniform_PC, bits_2):
    kid_table_M = _kid_tables(children_MC, table_M)

    def level(carry):
      depth, node, path, _ = carry
      kids_C = children_MC[node]
      kid_C = jnp.maximum(kids_C, 0)
      slot, bonus = cpu_kernel.rejection(
        filtered_logits(logits_MV[node], cfg),
        logq_GV[jnp.maximum(kid_table_M[node], 0)],
        jnp.where(kids_C >= 0, tokens_M[kid_C], -1),
        table_M[kid_C] >= 0,
        uniform_PC[jnp.minimum(depth, max_depth - 1)] if max_depth else jnp.zeros(num_slots),
        bits_2,
      )
      moved = slot >= 0
      node = jnp.where(moved, kids_C[jnp.maximum(slot, 0)], node)
      path = path.at[depth + 1].set(node, mode="drop")
      return (depth + moved, node, path, bonus), moved

    carry = (jnp.int32(0), jnp.int32(0), jnp.zeros((max_depth + 1,), jnp.int32), jnp.int32(0))
    # One level more than the tree has: a node at the deepest level has no children, and its
    # level draws the bonus.
    depth, node, path, bonus = _levels(level, carry, max_depth + 1)
    return _filled_path(path, node, depth_M[node]), bonus

  return jax.vmap(walk)(
    logits_BMV,
    logq_BGV,
    node_tokens_BM,
    node_table_BM,
    children_BMC,
    depth_BM,
    uniform_BPC,
    bits_B2,
  )


def recursive_rejection(
  logits_BMV, logq_BGV, node_tokens_BM, node_table_BM, children_BMC, depth_BM, uniform_BPC, cfg
):
  """The walk of `sampled_walk` with its uniforms given: (path_BP1, log_residual_BV).

  logits_BMV: the target's logits at every node, filtered by `cfg` (`filtered_logits`) as the
  walk reaches them; logq_BGV: the draft log-distributions; children_BMC, depth_BM: the
  tree's; uniform_BPC: one uniform per level and child slot. log_residual_BV is the log of the
  (unnormalised) distribution the bonus token is drawn from.
  """
  max_depth, num_slots = uniform_BPC.shape[1:]

  def walk(logits_MV, logq_GV, tokens_M, table_M, children_MC, depth_M, uniform_PC):
    p = lambda node: sampling.softmax(filtered_logits(logits_MV[node], cfg))
    kid_table_M = _kid_tables(children_MC, table_M)
    kid_q = lambda node: jnp.exp(logq_GV[jnp.maximum(kid_table_M[node], 0)].astype(jnp.float32))

    def level(carry):
      depth, node, p_V, r, path = carry
      kids_C = children_MC[node]

      def slot(inner):
        c, child, r, q_left = inner
        kid = jnp.maximum(kids_C[c], 0)
        token = tokens_M[kid]
        from_q = table_M[kid] >= 0
        # pi: q over the siblings not yet tried (q_left), renormalised; a point mass otherwise.
        q_mass = q_left.sum()
        # A drawn child of no q mass (q's support ran out before the siblings did) is no draft.
        tried = (kids_C[c] >= 0) & (~from_q | (q_left[token] > 0))
        pi_token = jnp.where(from_q, q_left[token] / jnp.where(q_mass > 0, q_mass, 1.0), 1.0)
        r_mass = r.sum()
        # r[token] > 0: rounding may leave r_mass a few ulps off the exact sum.
        accepted = tried & (r[token] > 0) & (uniform_PC[depth, c] * r_mass * pi_token < r[token])
        rejected = tried & ~accepted
        onehot = jnp.arange(r.shape[0]) == token
        pi = jnp.where(from_q, q_left / jnp.where(q_mass > 0, q_mass, 1.0), onehot)
        residual = jnp.maximum(r / jnp.where(r_mass > 0, r_mass, 1.0) - pi, 0.0)
        r = jnp.where(rejected, residual, r)
        q_left = jnp.where(rejected & from_q & onehot, 0.0, q_left)
        return c + 1, jnp.where(accepted, kid, child), r, q_left

      def untried(inner):  # vocabulary-sized steps only while a child is left to try
        c, child = inner[:2]
        return (child < 0) & jnp.any((kids_C >= 0) & (jnp.arange(num_slots) >= c))

      start = (jnp.int32(0), jnp.int32(-1), r, kid_q(node))
      _, child, r, _ = jax.lax.while_loop(untried, slot, start)
      moved = child >= 0
      node = jnp.where(moved, child, node)
      path = path.at[depth + 1].set(node)
      # A new node: its target distribution.
      p_V = jnp.where(moved, p(node), p_V)
      r = jnp.where(moved, p_V, r)
      return (depth + moved, node, p_V, r, path), moved

    p_root = p(0)
    carry = (jnp.int32(0), jnp.int32(0), p_root, p_root, jnp.zeros((max_depth + 1,), jnp.int32))
    depth, node, p_V, r, path = _levels(level, carry, max_depth)
    # In exact arithmetic a residual is never empty when it is reached; if rounding emptied it,
    # draw from the node's distribution instead.
    r = jnp.where(r.sum() > 0, r, p_V)
    return _filled_path(path, node, depth_M[node]), jnp.log(r)

  return jax.vmap(walk)(
    logits_BMV, logq_BGV, node_tokens_BM, node_table_BM, children_BMC, depth_BM, uniform_BPC
  )
