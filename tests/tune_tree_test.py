"""infer.tune_tree: the acceptance it measures is decoding's own, and its table is consistent."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from infer import tune_tree
from pspec_jax import decode, drafter_files, testing, tree_specs
from pspec_jax import propose as propose_lib
from pspec_jax import tree as tree_lib


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


def flawed_oracle(reference_BW):
  """Proposes the target's greedy continuation at rank 0, except at a fifth of the (position,
  depth) pairs, where the right token is rank 1: accepted paths of every depth and rank."""

  def propose(drafter, target, cache, pairs, context, pool):
    _, num_tokens = context
    index = num_tokens[:, None] + jnp.arange(pool.depth)
    right = jnp.take_along_axis(reference_BW, index, axis=1)
    wrong = (right + 1) % target.cfg.vocab_size
    flawed = (index * 7 + jnp.arange(pool.depth) * 3) % 5 == 0
    candidates = jnp.stack([jnp.where(flawed, wrong, right), jnp.where(flawed, right, wrong)], -1)
    logp = jnp.log(jnp.asarray([0.7, 0.3]))
    return cache, propose_lib._nodes_from_candidates(candidates, logp + 0 * candidates, pool)

  return propose


@pytest.mark.parametrize("pool", ["sparse8", "chain"])
def test_acceptance_rates_count_what_decoding_accepts(target, monkeypatch, pool):
  # EOS 3 and the budget cut some rounds short: both are counted as decoding counts them.
  cfg = decode.DecodeConfig(max_new_tokens=24, eos_ids=(3,), tree=pool)
  reference = decode.generate(target, *testing.padded(testing.PROMPTS), jax.random.key(0), cfg)
  full = np.zeros((len(testing.PROMPTS), 64), np.int32)
  for row, prompt in enumerate(testing.PROMPTS):
    full[row, : len(prompt)] = prompt
    full[row, len(prompt) : len(prompt) + 24] = reference.tokens[row]
  monkeypatch.setitem(propose_lib.PROPOSERS, "pld", flawed_oracle(jnp.asarray(full)))
  jax.clear_caches()  # jitted decoding traced by earlier tests holds the real pld proposer
  drafter = testing.drafter_for("pld", target)
  rates, rounds = tune_tree.acceptance_rates(target, drafter, testing.PROMPTS, cfg, batch_size=4)
  out = decode.generate(target, *testing.padded(testing.PROMPTS), jax.random.key(0), cfg, drafter)
  assert rounds == int(out.rounds.sum())
  tree = tree_specs.parse(pool, 4)
  assert set(rates) == set(tree.paths)
  per_depth = [sum(r for p, r in rates.items() if len(p) == d) for d in range(1, tree.depth + 1)]
  np.testing.assert_allclose(np.asarray(per_depth) * rounds, out.accepted_per_depth.sum(0))
  assert min(per_depth) > 0 and rates.get((1,), 1) > 0  # rank-1 nodes too, where present
  # tokens per round over the pool itself is decoding's tau, pooled over the prompts.
  tau = float((out.lengths - 1).sum() / out.rounds.sum())
  np.testing.assert_allclose(tree_lib.expected_tokens(tree, rates), tau, rtol=1e-6)


def test_tune_reports_plain_decoding_and_the_best_tree_of_each_size(target):
  drafter = testing.drafter_for("pspec", target)
  rows, rounds = tune_tree.tune(
    target,
    drafter,
    testing.PROMPTS[:2],
    pool_nodes=12,
    sizes=[2, 2, 40],
    max_new_tokens=16,
    eos_ids=(),
    repeats=2,
    batch_size=2,
  )
  assert rounds > 0
  assert [r["nodes"] for r in rows] == [1, 2, 12]  # once each; 40 is capped at the pool
  assert rows[0]["tree"] == "" and rows[0]["speedup"] == 1.0
  for r in rows[1:]:
    tree = tree_specs.parse(r["tree"], 4)
    assert tree.num_nodes == r["nodes"]
    assert r["ms"] > 0
    np.testing.assert_allclose(r["speedup"], r["tokens_per_round"] * rows[0]["ms"] / r["ms"])
  tokens = [r["tokens_per_round"] for r in rows]
  assert tokens == sorted(tokens)  # a larger best tree never expects fewer tokens


def test_stage_three_tries_the_tree_alone_chained_gated_and_the_chain_alone():
  assert tune_tree.tree_candidates("paths:0/1", [0.1, 0.25], 6) == [
    "paths:0/1",
    "paths:0/1+lookup:6",
    "paths:0/1+min:0.1+lookup:6",
    "paths:0/1+min:0.25+lookup:6",
    "lookup:6",
  ]
  assert tune_tree.tree_candidates("paths:0", [0.2], 0) == ["paths:0", "paths:0+min:0.2"]
  for spec in tune_tree.tree_candidates("paths:0/1", [0.1, 0.25], 6):
    tree_specs.parse(spec, 4)


def test_end_to_end_times_every_tree_at_every_temperature_and_picks_the_fastest(target):
  trees = tune_tree.tree_candidates("paths:0", [0.5], 2)
  rows, best = tune_tree.tune_end_to_end(
    target,
    testing.drafter_for("pspec", target),
    testing.PROMPTS[:2],
    trees,
    temperatures=[0.0, 1.0],
    max_new_tokens=8,
    eos_ids=(),
    pad_id=0,
    batch_size=1,
  )
  assert [(r["temperature"], r["tree"]) for r in rows] == [
    (t, tree) for t in (0.0, 1.0) for tree in ["", *trees]
  ]
  for r in rows:
    assert r["method"] == ("pspec" if r["tree"] else "none")
    assert r["tokens"] == 2 * 8 and r["tokens_per_s"] > 0
    assert r["lossless"] is (True if r["temperature"] == 0 else None)
  for t in (0.0, 1.0):
    mine = [r for r in rows if r["temperature"] == t and r["tree"]]
    assert best[t] == max(mine, key=lambda r: r["tokens_per_s"])["tree"]


def test_write_stores_the_choices_as_the_drafters_trees(target, tmp_path):
  drafter_files.save_drafter(str(tmp_path), testing.drafter_for("pspec", target))
  tune_tree.write_trees(str(tmp_path), {0.0: "paths:0+min:0.2+lookup:6", 1.0: "lookup:6"}, "cpu")
  loaded = drafter_files.load_drafter(str(tmp_path), target)
  assert loaded.cfg.tree == "paths:0+min:0.2+lookup:6"
  assert loaded.cfg.sampling_tree == "lookup:6"
  assert decode.resolve_tree(decode.DecodeConfig(), loaded).lookup == 6
  # Trees timed on one kind of device are that device's: another keeps the file's own.
  tune_tree.write_trees(str(tmp_path), {0.0: "sparse8"}, "gpu")
  on_gpu = drafter_files.read_drafter_config(str(tmp_path), target.cfg, "gpu")
  assert (on_gpu.tree, on_gpu.sampling_tree) == ("sparse8", "")
  assert drafter_files.load_drafter(str(tmp_path), target).cfg.tree == "paths:0+min:0.2+lookup:6"
  on_tpu = drafter_files.read_drafter_config(str(tmp_path), target.cfg, "tpu")
  assert on_tpu.tree == testing.drafter_for("pspec", target).cfg.tree


def test_write_without_a_drafter_directory_fails_before_loading_the_target(tmp_path):
  # A target of a config alone: loading its tokenizer or weights would be another error.
  transformers.LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
  ).save_pretrained(tmp_path)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "infer.tune_tree",
      f"--target={tmp_path}",
      "--drafter=random",
      "--write",
    ],
    cwd=root,
    env=testing.cli_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert result.stderr.strip() == (
    "error: --write needs a drafter directory (a trained drafter, not pld or random)"
  )
