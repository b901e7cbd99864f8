r"""Measure what a round with each candidate of an adaptive tree costs on this machine.

  python -m infer.calibrate                           # the shipped drafters, batch size 1
  python -m infer.calibrate --methods=pspec --batch_size=4
  python -m infer.calibrate --methods=eagle --tree="adaptive:paths:0|chain+lookup:6"
  python -m infer.calibrate --methods=pspec --temperature=1     # sampled rounds, drafts from q

Decoding programs measure missing costs by themselves at their first adaptive decode; this one
measures them again on demand (e.g. after a change to the machine), prints them with the times
they come from, and stores them where decoding reads them (`infer.calibration`).
"""

import jax
from absl import flags

from infer import calibration
from pspec_jax import checkpoints, cli, decode, drafter_files
from pspec_jax import prompts as prompts_lib
from pspec_jax.sampling import SamplingConfig

FLAGS = flags.FLAGS


def main():
  if FLAGS.batch_size < 1:
    raise ValueError(f"--batch_size must be >= 1, got {FLAGS.batch_size}")
  dtype = jax.numpy.dtype(FLAGS.dtype)
  tokenizer = checkpoints.load_tokenizer(FLAGS.target)
  # The first MT-Bench question is the context the rounds are timed at.
  prompt = prompts_lib.prompt_set("mt_bench", 1)[0]
  ids = prompts_lib.encode_prompt(tokenizer, prompt, tokenizer.chat_template is not None)
  # The layout decoding runs (panels on a CPU): the costs are kept per layout.
  target = checkpoints.load_target(
    FLAGS.target,
    dtype=dtype,
    param_dtype=dtype,
    weight_layout="decode",
  )
  # Sampled rounds are timed apart from greedy ones (the temperature itself costs nothing).
  sampling = SamplingConfig(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
  cfg = decode.DecodeConfig(tree=FLAGS.tree, sampling=sampling, drafts=FLAGS.drafts)
  for method in FLAGS.methods:
    drafter = drafter_files.resolve_drafter(method, FLAGS.drafter or None, target)
    if drafter is None:
      raise ValueError("--methods=none has no adaptive tree")
    costs = calibration.costs_for(
      target,
      drafter,
      cfg,
      FLAGS.batch_size,
      ids,
      prompts_lib.bucket(2 * len(ids)),  # the prompt twice (`calibration.measure`)
      path=FLAGS.out or None,
      log=print,
      recalibrate=True,
    )
    print(f"{method}: DecodeConfig(tree={FLAGS.tree!r}, costs={costs})\n", flush=True)


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  flags.DEFINE_string("target", "smollm2-135m-instruct", "Target name, HF directory, .gguf file.")
  flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "The target's weights and compute."
  )
  flags.DEFINE_list("methods", ["pld", "medusa", "eagle", "pspec"], "Drafting methods.")
  flags.DEFINE_string("drafter", "", "Drafter directory (one method); default: the shipped one.")
  flags.DEFINE_string("tree", "adaptive", "The adaptive tree: adaptive or adaptive:A|B|...")
  flags.DEFINE_integer("batch_size", 1, "Sequences per round.")
  flags.DEFINE_float("temperature", 0.0, "Time sampled rounds at this temperature (0: greedy).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass of the timed rounds (1 disables).")
  flags.DEFINE_integer("top_k", 0, "Top-k sampling of the timed rounds (0 disables).")
  flags.DEFINE_enum(
    "drafts", "sampled", list(decode.DRAFTS), "When sampling: drafts drawn from q, or top-k."
  )
  flags.DEFINE_string("out", "", "Calibration file; default: under pspec_jax.cache_dir.")


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
