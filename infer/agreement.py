r"""How often a drafter's first draft token is the target's: token by token, and round by round.

  python -m infer.generate --prompts=mt_bench --num_prompts=20 --json > answers.jsonl
  python -m infer.agreement --answers=answers.jsonl                 # the shipped pspec drafter
  python -m infer.agreement --answers=answers.jsonl --method=eagle
  python -m infer.generate --prompts=sharegpt --num_prompts=8 --temperature=1 --json > t1.jsonl
  python -m infer.agreement --answers=t1.jsonl --temperature=1      # and 1 - TV(p, q) at T = 1

`--answers` holds the target's greedy answers as `infer.generate --json` writes them, with the
same target and chat setting as here (temperature 0, any --method: on a float32 target they
are plain decoding's tokens). Over each answer the drafter runs teacher-forced, in
the training layout (which the decoder's proposals are tested to equal), and the program prints:
- per-token agreement: how often the drafter's depth-1 guess is the target's token;
- the same for single-token drafting (tree `paths:0`) round by round, replayed from those
  agreements: a hit moves the next round two tokens on, a miss one. Agreement that comes in
  runs makes rounds skip easy tokens, so per-round acceptance falls below per-token agreement;
- agreement after a hit and after a miss;
- with `--round_cost=C` (a round drafting one token, in plain rounds: `infer.calibration`'s
  `paths:0` row), the same single-token drafting replayed three ways, as tokens per plain
  round's time (the prefill left out): drafting every round; the adaptive choice between the
  root alone and one drafted token (`pspec_jax.adaptive`, its own statistics and choice, fed
  each round's outcome); and an oracle that drafts exactly where the draft is accepted, the
  most any choice of when to draft can give;
- the share of tokens in a repetition loop (the 3 tokens before them occurred earlier in the
  answer), and agreement there and elsewhere.
Held-out agreement in `train.distill` counts every answer token of its data; this counts what
decoding sees on the prompts you give.

With `--temperature=T` (answers sampled at T: `infer.generate --temperature=T --json`) it also
prints the mean depth-1 overlap sum_x min(p(x), q(x)) = 1 - TV(p, q) of the target's and the
drafter's distributions at T (both filtered alike): the probability that a draft drawn from q
is accepted by speculative sampling, the ceiling of depth-1 acceptance at T.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from pspec_jax import adaptive, checkpoints, cli, data, drafter_files, losses, tree_specs
from pspec_jax import prompts as prompts_lib
from pspec_jax.sampling import SamplingConfig, filtered_logits

FLAGS = flags.FLAGS


PAD_TO = 256  # sequences are padded to a multiple of this, so answers share compiled programs


def _padded(tokens: list[int]) -> jax.Array:
  """[1, S] the tokens, padded at the end to a multiple of `PAD_TO`: every position attends to
  the ones before it alone, so the padding changes nothing before it, and a set of answers
  compiles a few programs instead of one per length (20 s each for the embedded default)."""
  return jnp.asarray([tokens + [0] * (-len(tokens) % PAD_TO)])


def depth1_agreement(target, drafter, prompt: list[int], answer: list[int]) -> np.ndarray:
  """Whether the drafter's depth-1 guess for each answer token after the first is that token.

  Args:
    target, drafter: the target and a pspec, eagle or medusa drafter (`with_head` done).
    prompt, answer: token ids; the answer is the target's greedy continuation of the prompt.

  Returns:
    [len(answer) - 1] bool; entry j - 1 is answer token j. Token 0 comes from the prompt's
    pass, with nothing drafted for it; token j is guessed by pair len(prompt) + j - 2.
  """
  guess_S = np.asarray(losses.depth1_guesses(drafter, target, _padded(prompt + answer))[0])
  p = len(prompt)
  return guess_S[p - 1 : p + len(answer) - 2] == np.asarray(answer[1:])


def depth1_overlap(target, drafter, prompt: list[int], answer: list[int], sampling) -> np.ndarray:
  """[len(answer) - 1] sum_x min(p(x), q(x)) for answer tokens 1.., aligned with
  `depth1_agreement`: p the target's distribution of the token, q the drafter's depth-1 one
  (pair len(prompt) + j - 2 for token j), both filtered by `sampling`; q is spread over the
  target's vocabulary (0 outside a restricted draft vocabulary)."""
  target_SV, draft_SV = losses.depth1_logits(drafter, target, _padded(prompt + answer))
  n = len(prompt)
  # Token j sits at n + j: the target predicts it at n + j - 1, the drafter at pair n + j - 2.
  p = jax.nn.softmax(filtered_logits(target_SV[0, n : n + len(answer) - 1], sampling), -1)
  q = jax.nn.softmax(filtered_logits(draft_SV[0, n - 1 : n + len(answer) - 2], sampling), -1)
  if drafter.vocab is not None:
    q = jnp.zeros_like(p).at[:, drafter.vocab].set(q)
  return np.asarray(jnp.minimum(p, q).sum(-1))


def replay_rounds(agree_J: np.ndarray) -> tuple[int, int]:
  """(rounds, accepted) of single-token drafting over an answer with these agreements.

  A round keeps its draft when it is a hit, then the target's own token: it moves the next
  round two tokens on, a miss one. As in `decode.commit`, a round at the answer's last token
  (its EOS or the budget's end) keeps one token and counts no accepted draft.
  """
  rounds = accepted = 0
  j = 0
  while j < len(agree_J):
    kept = min(1 + bool(agree_J[j]), len(agree_J) - j)
    rounds, accepted, j = rounds + 1, accepted + kept - 1, j + kept
  return rounds, accepted


ONE_TOKEN = tree_specs.parse("adaptive:paths:0", 1)  # the root alone, or one drafted token


@jax.jit
def _choice_round(stats: adaptive.Stats, accepted: jax.Array) -> adaptive.Stats:
  """The statistics after a round of `ONE_TOKEN`'s chosen candidate that accepted `accepted`
  drafted tokens (0 or 1), with the next round's choice: what `rounds._option_round` observes
  and chooses, for one sequence and no lookup."""
  drafted = stats.choice > 0
  reach = jnp.stack([jnp.bool_(True), drafted])[None]
  path = jnp.stack([jnp.int32(0), accepted])[None]
  active = jnp.ones((1,), jnp.bool_)
  stats = adaptive.observe(stats, ONE_TOKEN, reach, path, accepted[None], active)
  choice, chain = adaptive.choose(stats, ONE_TOKEN, jnp.zeros((1,), jnp.int32), active)
  return stats.replace(choice=choice, chain=chain)


def replay_choice(agree_J: np.ndarray, round_cost: float) -> tuple[int, int, int]:
  """(rounds, accepted, drafted rounds) of greedy decoding whose every round either drafts one
  token (costing `round_cost` plain rounds) or verifies the root alone, as the adaptive choice
  picks from its statistics, which start at their priors (a fresh decode). Hits and the answer's
  end as in `replay_rounds`."""
  costs = ((1.0, 1.0), (float(round_cost), float(round_cost)))
  stats = adaptive.init_stats(ONE_TOKEN, 1, costs)
  choice, chain = adaptive.choose(stats, ONE_TOKEN, jnp.zeros((1,), jnp.int32), jnp.ones(1, bool))
  stats = stats.replace(choice=choice, chain=chain)
  rounds = accepted = drafted = 0
  j = 0
  while j < len(agree_J):
    draft = int(stats.choice) > 0
    kept = min(1 + (draft and bool(agree_J[j])), len(agree_J) - j)
    stats = _choice_round(stats, jnp.int32(kept - 1))
    rounds, accepted, drafted, j = rounds + 1, accepted + kept - 1, drafted + draft, j + kept
  return rounds, accepted, drafted


def _records(path: str) -> list[dict]:
  records = []
  with open(path) as fh:
    for number, line in enumerate(fh, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        prompt, tokens = record["prompt"], record["tokens"]
        if not isinstance(prompt, str) or not prompt or not isinstance(tokens, list):
          raise TypeError
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
          raise TypeError
      except (ValueError, KeyError, TypeError):
        raise ValueError(
          f"{path}:{number} is not an `infer.generate --json` record (a prompt and its token ids)"
        ) from None
      if len(tokens) >= 2:  # one token has nothing drafted for it
        records.append(record)
  if not records:
    raise ValueError(f"{path} holds no answer of 2 or more tokens")
  return records


def check_settings(
  records: list[dict], path: str, target: str, chat: bool, temperature: float = 0.0
) -> None:
  """The answers must be this target's, at this temperature (greedy by default), prompted as
  these flags prompt it (records from before `infer.generate` wrote its settings are taken on
  trust)."""
  for record in records:
    if record.get("temperature", temperature) != temperature:
      raise ValueError(
        f"{path}: answers sampled at T = {record['temperature']}; give T = {temperature:g} ones"
        " (--temperature)"
      )
    if record.get("target", target) != target:
      raise ValueError(f"{path}: answers of {record['target']}, but --target is {target}")
    if record.get("chat", chat) != chat:
      raise ValueError(
        f"{path}: answers generated with chat={record['chat']}; pass --chat={record['chat']}"
      )


def check_round_cost(round_cost: float, temperature: float) -> None:
  """One clear ValueError unless `round_cost` is 0 (no replay) or above 1 with greedy answers:
  the replay follows the greedy decoder's acceptance."""
  if round_cost and (round_cost <= 1 or temperature > 0):
    raise ValueError(
      "--round_cost must be above 1 (a round drafting one token, in plain rounds), with greedy "
      f"answers; got {round_cost:g} at T = {temperature:g}"
    )


def main() -> None:
  if FLAGS.method == "pld":
    raise ValueError("--method=pld has no drafter network to run teacher-forced")
  records = _records(FLAGS.answers)
  name = checkpoints.load_target_config(FLAGS.target).name
  drafter_files.drafter_source(FLAGS.method, FLAGS.drafter, name)
  tokenizer = checkpoints.load_tokenizer(FLAGS.target)
  chat = FLAGS.chat if FLAGS.chat is not None else tokenizer.chat_template is not None
  if FLAGS.temperature < 0:
    raise ValueError(f"--temperature must be >= 0, got {FLAGS.temperature}")
  check_settings(records, FLAGS.answers, name, chat, FLAGS.temperature)
  check_round_cost(FLAGS.round_cost, FLAGS.temperature)
  target = checkpoints.load_target(FLAGS.target, weight_layout="decode")
  drafter = drafter_files.resolve_drafter(FLAGS.method, FLAGS.drafter, target).with_head(target)
  sampling = SamplingConfig(temperature=FLAGS.temperature)
  agree, loops, overlap, rounds, accepted = [], [], [], 0, 0
  chosen = np.zeros(3, np.int64)  # the adaptive choice's rounds, accepted, drafted
  for record in records:
    if max(record["tokens"]) >= target.cfg.vocab_size:
      raise ValueError(f"{FLAGS.answers}: token ids past the target's vocabulary")
    prompt = prompts_lib.encode_prompt(tokenizer, record["prompt"], chat)
    hits = depth1_agreement(target, drafter, prompt, record["tokens"])
    if not sampling.greedy:
      overlap.append(depth1_overlap(target, drafter, prompt, record["tokens"], sampling))
    r, acc = replay_rounds(hits)
    if FLAGS.round_cost:
      chosen += replay_choice(hits, FLAGS.round_cost)
    agree.append(hits)
    loops.append(data.in_loop(record["tokens"]))
    rounds, accepted = rounds + r, accepted + acc
  hit, loop = np.concatenate(agree), np.concatenate(loops)
  this = np.concatenate([x[1:] for x in agree])  # each token's agreement ...
  before = np.concatenate([x[:-1] for x in agree])  # ... and the one before it
  rate = lambda x: f"{x.mean():.3f} ({x.size} tokens)" if x.size else "-"
  print(f"{FLAGS.method} drafter on {len(records)} answers ({FLAGS.answers})")
  print(f"per-token depth-1 agreement: {rate(hit)}")
  print(f"single-token drafting, replayed: {rounds} rounds, acceptance {accepted / rounds:.3f}")
  print(f"agreement after a hit: {rate(this[before])}; after a miss: {rate(this[~before])}")
  print(f"tokens in a loop (the 3 before them occurred earlier in the answer): {loop.mean():.3f}")
  print(f"agreement in loops: {rate(hit[loop])}; elsewhere: {rate(hit[~loop])}")
  if FLAGS.round_cost:
    c = FLAGS.round_cost
    speed = lambda r, acc, drafted: f"{(r + acc) / (r - drafted + c * drafted):.3f}"
    r, acc, drafted = (int(x) for x in chosen)
    print(
      f"single-token drafting at {c:g} plain rounds a round, tokens per plain round's time: every "
      f"round {speed(rounds, accepted, rounds)}; the adaptive choice {speed(r, acc, drafted)} "
      f"(drafted {drafted / r:.0%} of rounds, acceptance {acc / max(drafted, 1):.3f}); drafting "
      f"exactly where accepted {speed(rounds, accepted, accepted)}"
    )
  if overlap:
    overlap = np.concatenate(overlap)
    print(f"depth-1 1 - TV(p, q) at T = {FLAGS.temperature:g}: {rate(overlap)}")


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  flags.DEFINE_string("answers", None, "JSONL of `infer.generate --json` records at T = 0.")
  flags.DEFINE_string("target", "smollm2-135m-instruct", "Target name, HF directory or .gguf file.")
  flags.DEFINE_enum("method", "pspec", ["pspec", "eagle", "medusa", "pld"], "Drafter kind.")
  flags.DEFINE_string("drafter", None, "Drafter directory; default: the shipped one.")
  flags.DEFINE_bool("chat", None, "Apply the chat template (default: when the tokenizer has one).")
  flags.DEFINE_float(
    "temperature", 0.0, "The answers' temperature; above 0 also prints depth-1 1 - TV(p, q) at it."
  )
  flags.DEFINE_float(
    "round_cost",
    0.0,
    "A round drafting one token, in plain rounds (> 1; infer.calibration's paths:0 row): also "
    "replays single-token drafting every round, by the adaptive choice, and where accepted.",
  )
  flags.mark_flag_as_required("answers")


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
