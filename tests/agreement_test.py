"""`infer.agreement`: teacher-forced depth-1 agreement, and rounds replayed from it."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from infer import agreement
from pspec_jax import checkpoints, decode, drafter_files
from pspec_jax import prompts as prompts_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_hit_moves_the_next_round_two_tokens_on_a_miss_one():
  # rounds start at agreement indices 0 (hit), 2 (miss), 3 (hit), 5 (hit); 7 is past the end
  assert agreement.replay_rounds(np.array([1, 0, 0, 1, 1, 1, 0], bool)) == (4, 3)
  assert agreement.replay_rounds(np.array([0, 0, 0], bool)) == (3, 0)
  # a hit on the answer's last token keeps that token alone, as the decoder counts it
  assert agreement.replay_rounds(np.array([1, 0, 1], bool)) == (2, 1)
  assert agreement.replay_rounds(np.array([], bool)) == (0, 0)


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
def test_replayed_rounds_are_the_decoders(smollm2, kind):
  """Single-token drafting with the shipped drafter, replayed from teacher-forced agreement,
  takes exactly the decoder's rounds and accepts exactly its draft tokens."""
  target, tokenizer = smollm2
  drafter = drafter_files.load_drafter(drafter_files.shipped_drafter(target.cfg.name, kind), target)
  # The first answer ends at EOS within the budget, the second runs to it.
  prompts = ["What is 2 + 2? Answer with one number.", "Count from 1 to 50."]
  eos = checkpoints.eos_token_ids(target.cfg.name, tokenizer)
  cfg = decode.DecodeConfig(
    max_new_tokens=40, tree="paths:0", eos_ids=eos, pad_id=tokenizer.pad_token_id
  )
  # The adaptive choice between the root alone and one drafted token, at a cost where drafting
  # pays from an acceptance of 0.39 up.
  choosing = dataclasses.replace(cfg, tree="adaptive:paths:0", costs=((1.0, 1.0), (1.39, 1.39)))
  lengths_seen = []
  hits, drafted = [], []
  for text in prompts:
    prompt = prompts_lib.encode_prompt(tokenizer, text, chat=True)
    tokens, lengths = prompts_lib.pad_batch([prompt])
    out = jax.device_get(decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter))
    answer = np.asarray(out.tokens[0, : out.lengths[0]]).tolist()
    lengths_seen.append((len(answer), answer[-1] in eos))
    agree = agreement.depth1_agreement(target, drafter.with_head(target), prompt, answer)
    assert agree.shape == (len(answer) - 1,)
    rounds, accepted = agreement.replay_rounds(agree)
    assert rounds == int(out.rounds[0])
    assert accepted == int(np.asarray(out.accepted_per_depth[0]).sum())
    hits.extend(agree)
    # The replayed choice takes the adaptive decoder's every round.
    out = jax.device_get(
      decode.generate(target, tokens, lengths, jax.random.key(0), choosing, drafter)
    )
    assert np.asarray(out.tokens[0, : out.lengths[0]]).tolist() == answer
    rounds, accepted, drafted_rounds = agreement.replay_choice(agree, 1.39)
    assert rounds == int(out.rounds[0])
    assert accepted == int(np.asarray(out.accepted_per_depth[0]).sum())
    assert [rounds - drafted_rounds, drafted_rounds] == out.chosen.tolist()
    drafted.append(drafted_rounds)
  assert 0 < np.mean(hits) < 1  # both outcomes were replayed
  assert sum(drafted) > 0  # so was drafting
  assert lengths_seen[0][0] < 40 and lengths_seen[0][1] and lengths_seen[1][0] == 40


def test_the_choice_replayed_drafts_where_drafts_are_accepted():
  """`replay_choice` over made-up agreement: drafting goes on while drafts are accepted, stops
  within a few rounds once they are not, and counts rounds and tokens as `replay_rounds` does."""
  rounds, accepted, drafted = agreement.replay_choice(np.ones(100, bool), 1.39)
  assert (rounds, accepted, drafted) == (50, 50, 50)
  rounds, accepted, drafted = agreement.replay_choice(np.zeros(100, bool), 1.39)
  assert (rounds, accepted) == (100, 0) and 0 < drafted <= 6
  # Hits on odd tokens only: the first round (token 0) drafts on its prior and misses, which
  # puts the next on token 1; from there every round drafts, hits and moves on two, but the
  # last (token 99) keeps the answer's last token alone.
  rounds, accepted, drafted = agreement.replay_choice(np.arange(100) % 2 == 1, 1.39)
  assert (rounds, accepted, drafted) == (51, 49, 51)
  assert agreement.replay_choice(np.array([], bool), 1.39) == (0, 0, 0)


def test_a_bad_round_cost_is_one_clear_error():
  agreement.check_round_cost(0.0, 1.0)  # no replay: any temperature
  agreement.check_round_cost(1.39, 0.0)
  for cost, temperature in [(1.0, 0.0), (-2.0, 0.0), (1.39, 0.7)]:
    with pytest.raises(ValueError, match="--round_cost must be above 1"):
      agreement.check_round_cost(cost, temperature)


def test_bad_answers_are_one_clear_line(tmp_path):
  bad = tmp_path / "answers.jsonl"
  bad.write_text('{"prompt": "hi"}\n')
  result = subprocess.run(
    [sys.executable, "-m", "infer.agreement", f"--answers={bad}"],
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
  )
  assert result.returncode != 0
  assert (
    result.stderr.strip()
    == f"error: {bad}:1 is not an `infer.generate --json` record (a prompt and its token ids)"
  )


def test_answers_of_other_settings_are_refused():
  record = dict(prompt="hi", tokens=[1, 2], target="smollm2-135m-instruct", chat=True)
  agreement.check_settings([record], "a.jsonl", "smollm2-135m-instruct", True)
  agreement.check_settings([dict(prompt="hi", tokens=[1, 2])], "a.jsonl", "other", False)
  cases = [
    (
      dict(record, temperature=0.7),
      "a.jsonl: answers sampled at T = 0.7; give T = 0 ones (--temperature)",
    ),
    (
      dict(record, target="tiny"),
      "a.jsonl: answers of tiny, but --target is smollm2-135m-instruct",
    ),
    (dict(record, chat=False), "a.jsonl: answers generated with chat=False; pass --chat=False"),
  ]
  for bad, message in cases:
    with pytest.raises(ValueError) as error:
      agreement.check_settings([record, bad], "a.jsonl", "smollm2-135m-instruct", True)
    assert str(error.value) == message


@pytest.mark.parametrize("kind", ["pspec", "medusa"])
def test_depth1_overlap_is_the_decoders_acceptance_probability(kind):
  """1 - TV(p, q) of the first drafted token, teacher-forced, from the distributions the decoder
  draws and verifies the first round's draft with (a restricted draft vocabulary included)."""
  import jax.numpy as jnp

  from pspec_jax import drafter as drafter_lib
  from pspec_jax import testing
  from pspec_jax.sampling import SamplingConfig, filtered_logits

  target = testing.make_target(5.0)
  drafter = testing.drafter_for(kind, target).with_head(target)
  if kind == "medusa":  # the draft vocabulary: the first 12 of 16 tokens
    drafter = drafter_lib.random_drafter(kind, target, jax.random.key(1), draft_vocab_size=12)
  sampling = SamplingConfig(temperature=0.8, top_k=9)
  prompt = [5, 9, 2, 13, 7]
  cfg = decode.DecodeConfig(max_new_tokens=2, sampling=sampling, tree="chain")
  tokens, lengths = testing.padded([prompt])
  plan = decode.make_plan(cfg, drafter, tokens.shape[1])
  state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
  bonus = int(state.tokens[0, len(prompt)])
  q = np.exp(np.asarray(state.draft_logq[0, 0]))  # depth 1: what x_{n+2} is drawn from
  features, _ = target(jnp.asarray([prompt + [bonus]]), jnp.arange(len(prompt) + 1)[None])
  p = np.asarray(jax.nn.softmax(filtered_logits(target.logits(features[:, -1]), sampling)))[0]
  overlap = agreement.depth1_overlap(target, drafter, prompt, [bonus, 0, 0], sampling)
  assert overlap.shape == (2,)
  np.testing.assert_allclose(overlap[0], np.minimum(p, q).sum(), rtol=1e-5)
  assert 0 < overlap[0] < 1
