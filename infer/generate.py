r"""Generate text for one prompt or a file of prompts.

  python -m infer.generate --prompt="Write a haiku about JAX."
  python -m infer.generate --prompts=prompts.jsonl --batch_size=4 --json
  python -m infer.generate --prompts=mt_bench --num_prompts=20 --method=pspec --json
  python -m infer.generate --target=path/to/hf_dir --temperature=0.7 --top_p=0.9 --seed=1
  python -m infer.generate --prompt="..." --method=pld --num_draft=6
  python -m infer.generate --prompt="..." --method=pspec --temperature=1 --drafts=top_k
  python -m infer.generate --prompt="..." --method=pspec   # the shipped drafter of the target
  python -m infer.generate --prompt="..." --method=eagle --drafter=workdirs/eagle/export \
      --tree=dynamic:16

On a terminal, text streams as it is generated (batch size 1); `--json` prints one JSON object
per prompt instead.
"""

import dataclasses
import json
import sys
import time

import jax
import numpy as np
from absl import flags

from infer import calibration
from pspec_jax import checkpoints, cli, decode, drafter_files, sharding, tree_specs
from pspec_jax import prompts as prompts_lib
from pspec_jax.sampling import SamplingConfig

FLAGS = flags.FLAGS


def _prompts() -> list[str]:
  if (FLAGS.prompt is None) == (FLAGS.prompts is None):
    raise ValueError("give exactly one of --prompt and --prompts")
  if FLAGS.num_prompts < 0:
    raise ValueError(f"--num_prompts must be >= 0, got {FLAGS.num_prompts}")
  if FLAGS.prompt is not None:
    return [FLAGS.prompt]
  return prompts_lib.prompts_from(FLAGS.prompts, FLAGS.num_prompts)


def main() -> None:
  sampling = SamplingConfig(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
  if FLAGS.batch_size < 1:
    raise ValueError(f"--batch_size must be >= 1, got {FLAGS.batch_size}")
  prompts = _prompts()
  # Flag errors first: they need no model.
  if FLAGS.tree and FLAGS.tree != "fixed":
    tree_specs.parse(FLAGS.tree, FLAGS.num_draft or 8)
  if FLAGS.num_draft is not None and FLAGS.num_draft < 1:
    raise ValueError(f"--num_draft must be >= 1, got {FLAGS.num_draft}")
  if FLAGS.method == "none":
    check_num_draft(FLAGS.num_draft, None, None)
  mesh = sharding.make_mesh(**sharding.parse_mesh(FLAGS.mesh)) if FLAGS.mesh else None
  # The drafter's flags, checked before the target's weights are read.
  drafter_files.drafter_source(
    FLAGS.method, FLAGS.drafter, checkpoints.load_target_config(FLAGS.target).name
  )
  tokenizer = checkpoints.load_tokenizer(FLAGS.target)
  chat = FLAGS.chat if FLAGS.chat is not None else tokenizer.chat_template is not None
  encoded = [prompts_lib.encode_prompt(tokenizer, p, chat) for p in prompts]
  target = checkpoints.load_target(FLAGS.target, weight_layout="decode", mesh=mesh)
  drafter = drafter_files.resolve_drafter(
    FLAGS.method, FLAGS.drafter, target, seed=FLAGS.seed, num_draft=FLAGS.num_draft or 4
  )
  cfg = decode.DecodeConfig(
    max_new_tokens=FLAGS.max_new_tokens,
    sampling=sampling,
    eos_ids=checkpoints.eos_token_ids(FLAGS.target, tokenizer),
    pad_id=tokenizer.pad_token_id or 0,
    num_draft=FLAGS.num_draft or 0,
    tree=FLAGS.tree or "",
    mesh=mesh,
    drafts=FLAGS.drafts,
  )
  if mesh is not None:
    _, drafter = decode.shard(mesh, target, drafter)
  check_num_draft(FLAGS.num_draft, cfg, drafter)
  depth = decode.resolve_tree(cfg, drafter).max_depth
  max_width = target.cfg.max_position_embeddings - cfg.max_new_tokens - depth
  if drafter is not None and decode.resolve_tree(cfg, drafter).candidates:
    # An adaptive tree weighs this machine's round costs: measured once (in the program that
    # decodes the first batch), then read back.
    first = encoded[: FLAGS.batch_size]
    width = prompts_lib.pad_batch(first, max_width=max_width)[0].shape[1]
    costs = calibration.costs_for(target, drafter, cfg, len(first), encoded[0], width)
    cfg = dataclasses.replace(cfg, costs=costs)
  live = sys.stdout.isatty() and not FLAGS.json and FLAGS.batch_size == 1
  key = jax.random.key(FLAGS.seed)
  total = dict(tokens=0, drafted=0, rounds=0, seconds=0.0, compile_seconds=0.0)
  for start in range(0, len(prompts), FLAGS.batch_size):
    batch = encoded[start : start + FLAGS.batch_size]
    tokens, lengths = prompts_lib.pad_batch(batch, max_width=max_width)
    key, batch_key = jax.random.split(key)
    began = time.perf_counter()
    if live:
      print(f"> {prompts[start]}\n", flush=True)
      generated, shown, rounds = [], "", -1  # the first yield is the prefill's token
      with cli.CompileClock() as clock:
        for new in decode.stream(target, tokens, lengths, batch_key, cfg, drafter):
          generated.extend(new[0].tolist())
          rounds += 1
          text = tokenizer.decode(generated, skip_special_tokens=True)
          print(text[len(shown) :], end="", flush=True)
          shown = text
      print("\n", flush=True)
      _add(total, len(generated), max(len(generated) - 1, 0), rounds, began, clock)
      continue
    with cli.CompileClock() as clock:
      out = jax.device_get(decode.generate(target, tokens, lengths, batch_key, cfg, drafter))
    # Decoding alone: the first batch of a shape also traces and compiles (or reads the
    # compiled program from the cache), reported apart as compile_seconds.
    seconds = time.perf_counter() - began - clock.seconds
    _add(
      total,
      int(out.lengths.sum()),
      int((out.lengths - 1).clip(0).sum()),
      int(out.rounds.sum()),
      began,
      clock,
    )
    for row, prompt in enumerate(prompts[start : start + len(batch)]):
      ids = np.asarray(out.tokens[row, : out.lengths[row]]).tolist()
      text = tokenizer.decode(ids, skip_special_tokens=True)
      if FLAGS.json:
        record = dict(
          prompt=prompt,
          target=target.cfg.name,
          chat=chat,
          temperature=FLAGS.temperature,
          text=text,
          tokens=ids,
          num_tokens=len(ids),
          seconds=round(seconds, 4),
          compile_seconds=round(clock.seconds, 4),
          rounds=int(out.rounds[row]),
          tau=round(float(out.tau[row]), 4),
          accepted_per_depth=np.asarray(out.accepted_per_depth[row]).tolist(),
        )
        print(json.dumps(record), flush=True)
      else:
        print(f"> {prompt}\n\n{text}\n", flush=True)
  if not FLAGS.json:
    tree = "" if drafter is None else drafter.cfg.tree_for(sampling.greedy, cfg.tree)
    print(summary(total, FLAGS.method, tree, FLAGS.num_draft or 0), file=sys.stderr, flush=True)


def _add(total: dict, tokens: int, drafted: int, rounds: int, began: float, clock) -> None:
  """Adds one batch to the run's totals (`drafted`: tokens after each sequence's first)."""
  compile_seconds = clock.seconds
  total["tokens"] += tokens
  total["drafted"] += drafted
  total["rounds"] += rounds
  total["compile_seconds"] += compile_seconds
  total["seconds"] += time.perf_counter() - began - compile_seconds


def summary(total: dict, method: str, tree: str, num_draft: int) -> str:
  """The run in one line: tokens, decode speed, tau, and the method and tree used."""
  seconds = max(total["seconds"], 1e-9)
  tau = total["drafted"] / max(total["rounds"], 1)
  how = f"method {method}" + (f", tree {tree}" if tree else "")
  how += f", K={num_draft}" if num_draft else ""
  return (
    f"{total['tokens']} tokens in {seconds:.2f} s ({total['tokens'] / seconds:.1f} tokens/s; "
    f"compiling {total['compile_seconds']:.1f} s more), tau {tau:.2f} tokens per target pass, "
    f"{how}"
  )


def check_num_draft(num_draft: int | None, cfg, drafter) -> None:
  """`--num_draft` must change what is decoded: a tree that fixes its own depth (explicit
  rank paths, `lookup:L`), or plain decoding, would silently ignore it."""
  if num_draft is None:
    return
  if drafter is None:
    raise ValueError("--num_draft needs a drafting method (--method=pspec, eagle, medusa, pld)")
  spec = drafter.cfg.tree_for(cfg.sampling.greedy, cfg.tree)
  own = drafter.cfg.num_draft
  # The tree decoding resolves (an adaptive tree's candidates spelled out) at either K.
  sized = lambda k: decode.resolve_tree(dataclasses.replace(cfg, num_draft=k), drafter)
  if num_draft != own and sized(num_draft) == sized(own):
    raise ValueError(
      f"--num_draft={num_draft} would change nothing: the tree {spec!r} fixes its own depth. "
      "Give a tree that K sizes (--tree=chain, sparseN or dynamic:N), or drop --num_draft"
    )


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  flags.DEFINE_string("target", "smollm2-135m-instruct", "Target name, HF directory or .gguf file.")
  flags.DEFINE_string("prompt", None, "One prompt.")
  flags.DEFINE_string(
    "prompts",
    None,
    'JSONL file of {"prompt": ...} lines or MT-Bench questions, or a packaged set: '
    "mt_bench, humaneval, sharegpt (its held-out split).",
  )
  flags.DEFINE_integer("num_prompts", 0, "Only the first N prompts of --prompts (0: all).")
  flags.DEFINE_integer("max_new_tokens", 128, "Generation budget per prompt.")
  flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 disables).")
  flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 disables).")
  flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
  flags.DEFINE_integer("batch_size", 1, "Prompts decoded together.")
  flags.DEFINE_bool("chat", None, "Apply the chat template (default: when the tokenizer has one).")
  flags.DEFINE_bool("json", False, "Print one JSON object per prompt.")
  flags.DEFINE_enum(
    "method", "none", ["none", "pspec", "eagle", "medusa", "pld"], "Drafting method."
  )
  flags.DEFINE_string(
    "drafter", None, "Drafter directory, or `random` (untrained, seeded); default: the shipped one."
  )
  flags.DEFINE_integer("num_draft", None, "K, draft tokens per round (default: the drafter's).")
  flags.DEFINE_string(
    "tree",
    None,
    "Tree: chain, sparseN, dynamic:N or paths:0/0.0/1, each with an optional gate +min:P, "
    "then +lookup:L; adaptive (chosen each round) or fixed (the drafter's fixed tree); "
    "default: the drafter's.",
  )
  flags.DEFINE_string(
    "mesh", "", "Shard over a device mesh, e.g. data=2,tensor=4 (default: one device)."
  )
  flags.DEFINE_enum(
    "drafts",
    "sampled",
    ["sampled", "top_k"],
    "When sampling: draw the drafted tree from the drafter's distribution and accept it by "
    "(recursive) speculative sampling, or take its top-k tokens and accept them by the "
    "deterministic rule.",
  )


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
