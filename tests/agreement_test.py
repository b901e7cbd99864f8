"""`infer.agreement`: teacher-forced depth-1 agreement, and rounds replayed from it."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from infer import agreement
from pspec_jax import checkpoints, data, decode, drafter_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_hit_moves_the_next_round_two_tokens_on_a_miss_one():
  # rounds start at answer tokens 0 (hit), 2 (miss), 3 (hit), 5 (hit); 7 is past the end
  assert agreement.replay_rounds(np.array([1, 0, 0, 1, 1, 1, 0], bool)) == (4, 3)
  assert agreement.replay_rounds(np.array([0, 0, 0], bool)) == (3, 0)
  assert agreement.replay_rounds(np.array([], bool)) == (0, 0)


def test_repeated_ngrams_marks_tokens_that_close_an_earlier_ngram():
  answer = [1, 2, 3, 4, 1, 2, 3, 4, 5]
  # aligned to answer[1:]: the 4-gram ending at token 7 ([1, 2, 3, 4]) is the first repeat
  expected = [False] * 6 + [True, False]
  np.testing.assert_array_equal(agreement.repeated_ngrams(answer), expected)
  np.testing.assert_array_equal(agreement.repeated_ngrams(answer, n=1), [0, 0, 0, 1, 1, 1, 1, 0])


@pytest.mark.parametrize("kind", ["pspec", "medusa"])
def test_replayed_rounds_are_the_decoders(smollm2, kind):
  """Single-token drafting with the shipped drafter, replayed from teacher-forced agreement,
  takes exactly the decoder's rounds and accepts exactly its draft tokens."""
  _, tokenizer = smollm2
  target = checkpoints.load_target("smollm2-135m-instruct", scan_layers=False)
  drafter = drafter_files.load_drafter(drafter_files.shipped_drafter(target.cfg.name, kind), target)
  prompts = ["What is the capital of France? Answer in two sentences.", "Count from 1 to 20."]
  cfg = decode.DecodeConfig(max_new_tokens=40, tree="paths:0", pad_id=tokenizer.pad_token_id)
  hits = []
  for text in prompts:
    prompt = data.encode_prompt(tokenizer, text, chat=True)
    tokens, lengths = data.pad_batch([prompt])
    out = jax.device_get(decode.generate(target, tokens, lengths, jax.random.key(0), cfg, drafter))
    answer = np.asarray(out.tokens[0, : out.lengths[0]]).tolist()
    agree = agreement.depth1_agreement(target, drafter.with_head(target), prompt, answer)
    assert agree.shape == (len(answer) - 1,)
    rounds, accepted = agreement.replay_rounds(agree)
    assert rounds == int(out.rounds[0])
    assert accepted == int(np.asarray(out.accepted_per_depth[0]).sum())
    hits.extend(agree)
  assert 0 < np.mean(hits) < 1  # both outcomes were replayed


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
    == f"error: {bad}:1 is not an `infer.generate --json` record (prompt, tokens)"
  )
