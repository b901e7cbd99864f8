r"""How often a drafter's first draft token is the target's: token by token, and round by round.

  python -m infer.generate --prompts=mt_bench --num_prompts=20 --json > answers.jsonl
  python -m infer.agreement --answers=answers.jsonl                 # the shipped pspec drafter
  python -m infer.agreement --answers=answers.jsonl --method=eagle

`--answers` holds the target's greedy answers as `infer.generate --json` writes them (temperature
0, any --method: all give the same tokens). Over each answer the drafter runs teacher-forced, in
the training layout (which the decoder's proposals are tested to equal), and the program prints:
- per-token agreement: how often the drafter's depth-1 guess is the target's token;
- the same for single-token drafting (tree `paths:0`) round by round, replayed from those
  agreements: a hit moves the next round two tokens on, a miss one. Agreement that comes in
  runs makes rounds skip easy tokens, so per-round acceptance falls below per-token agreement;
- agreement after a hit and after a miss;
- the share of tokens whose 4-gram repeats earlier in the answer (loops, which are easy to
  predict), and agreement on those tokens and on the others.
Held-out agreement in `train.distill` counts every token of its data; this counts what decoding
sees on the prompts you give.
"""

import json

import numpy as np
from absl import flags

from pspec_jax import cli

FLAGS = flags.FLAGS


def depth1_agreement(target, drafter, prompt: list[int], answer: list[int]) -> np.ndarray:
  """[len(answer) - 1] bool: whether the drafter's depth-1 guess for answer token j (j >= 1)
  is that token. Answer token 0 comes from the prompt's pass, with nothing drafted for it.

  Pair a = (f_a, x_{a+1}) guesses x_{a+2} (medusa: its first head on f_a), so the guess for
  answer token j comes from pair a = len(prompt) + j - 2.
  """
  import jax.numpy as jnp

  from pspec_jax import losses
  from pspec_jax.drafter import FeatureDrafter

  seq = jnp.asarray([prompt + answer], jnp.int32)
  segments = jnp.ones_like(seq)
  positions, mask = losses.segment_positions(segments), losses.segment_mask(segments)
  features, _ = target(seq, positions, None, mask)
  if drafter.cfg.kind == "medusa":
    g = drafter.apply(features[0])[:, 0]
  else:
    g, _ = drafter.apply(
      target.embed(losses.shifted(seq, 1)),
      features,
      positions,
      mask,
      None,
      method=FeatureDrafter.train_forward,
    )
    g = g[0]
  guess = np.asarray(jnp.argmax(drafter.logits(target, g), -1))
  if drafter.vocab is not None:
    guess = np.asarray(drafter.vocab)[guess]
  p = len(prompt)
  return guess[p - 1 : p + len(answer) - 2] == np.asarray(answer[1:])


def replay_rounds(agree: np.ndarray) -> tuple[int, int]:
  """(rounds, accepted) of single-token drafting over an answer with these agreements."""
  rounds = accepted = 0
  j = 0
  while j < len(agree):
    rounds += 1
    accepted += bool(agree[j])
    j += 2 if agree[j] else 1
  return rounds, accepted


def repeated_ngrams(answer: list[int], n: int = 4) -> np.ndarray:
  """[len(answer) - 1] bool: whether the n-gram ending at answer token j (j >= 1) occurred
  earlier in the answer."""
  seen, out = set(), []
  for j in range(len(answer)):
    gram = tuple(answer[j - n + 1 : j + 1]) if j >= n - 1 else None
    if j:
      out.append(gram in seen)
    if gram is not None:
      seen.add(gram)
  return np.asarray(out, bool)


def _records(path: str) -> list[dict]:
  records = []
  with open(path) as fh:
    for number, line in enumerate(fh, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        records.append(dict(prompt=str(record["prompt"]), tokens=list(record["tokens"])))
      except (ValueError, KeyError, TypeError):
        raise ValueError(
          f"{path}:{number} is not an `infer.generate --json` record (prompt, tokens)"
        ) from None
  if not records:
    raise ValueError(f"{path} holds no answers")
  return records


def run() -> None:
  import transformers

  from pspec_jax import checkpoints, data, drafter_files

  transformers.logging.set_verbosity_error()
  if FLAGS.method == "pld":
    raise ValueError("--method=pld has no drafter network to run teacher-forced")
  records = _records(FLAGS.answers)
  drafter_files.drafter_source(
    FLAGS.method, FLAGS.drafter, checkpoints.load_target_config(FLAGS.target).name
  )
  tokenizer = checkpoints.load_tokenizer(FLAGS.target)
  chat = FLAGS.chat if FLAGS.chat is not None else tokenizer.chat_template is not None
  target = checkpoints.load_target(FLAGS.target, scan_layers=False)
  drafter = drafter_files.resolve_drafter(FLAGS.method, FLAGS.drafter, target).with_head(target)
  agree, repeats, rounds, accepted = [], [], 0, 0
  for record in records:
    prompt = data.encode_prompt(tokenizer, record["prompt"], chat)
    a = depth1_agreement(target, drafter, prompt, record["tokens"])
    r, acc = replay_rounds(a)
    agree.append(a)
    repeats.append(repeated_ngrams(record["tokens"]))
    rounds, accepted = rounds + r, accepted + acc
  a, rep = np.concatenate(agree), np.concatenate(repeats)
  after = np.concatenate([x[1:] for x in agree]), np.concatenate([x[:-1] for x in agree])
  rate = lambda x: f"{x.mean():.3f} ({x.size} tokens)" if x.size else "-"
  print(f"{FLAGS.method} drafter on {len(records)} answers ({FLAGS.answers})")
  print(f"per-token depth-1 agreement: {rate(a)}")
  print(f"single-token drafting, replayed: {rounds} rounds, acceptance {accepted / rounds:.3f}")
  print(
    f"agreement after a hit: {rate(after[0][after[1]])}; after a miss: {rate(after[0][~after[1]])}"
  )
  print(f"tokens whose 4-gram repeats earlier in the answer: {rep.mean():.3f}")
  print(f"agreement on them: {rate(a[rep])}; on the others: {rate(a[~rep])}")


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  flags.DEFINE_string("answers", None, "JSONL of `infer.generate --json` records at T = 0.")
  flags.DEFINE_string("target", "smollm2-135m-instruct", "Target name, HF directory or .gguf file.")
  flags.DEFINE_enum("method", "pspec", ["pspec", "eagle", "medusa", "pld"], "Drafter kind.")
  flags.DEFINE_string("drafter", None, "Drafter directory; default: the shipped one.")
  flags.DEFINE_bool("chat", None, "Apply the chat template (default: when the tokenizer has one).")
  flags.mark_flag_as_required("answers")


if __name__ == "__main__":
  cli.run(run, define_flags)
