r"""Where a speculative round spends its time, and what verifying N tree nodes costs.

  python -m infer.profile_round                       # random pspec drafter and pld, K=4
  python -m infer.profile_round --methods=pld,eagle --num_draft=6 --tree=sparse16
  python -m infer.profile_round --target=random:llama2_7b --dtype=bfloat16   # on a GPU
  python -m infer.profile_round --methods=pspec \
      --drafter=pspec_jax/drafters/smollm2-135m-instruct/pspec --tree=paths:0+lookup:6 \
      --nodes=1,2,4,8 --read_ahead=0,1048576   # with part 4

Part 1 runs each method's rounds one phase at a time from the host (each phase jitted on its
own, timed after `block_until_ready`): draft, verify, accept+commit, in ms per round and as
shares, against the time per round of the same decode run whole (every round inside one
jitted `while_loop`, as `pspec_jax.decode` runs it); both decode every prompt to
`--max_new_tokens` (EOS off). Part 2 times the verification pass alone
for trees of N = 1, 2, 4, ... nodes (N = 1 is the root alone) at the same context, relative to
one whole auto-regressive round. Part 3 sets the plain decode step against the memory-bandwidth
floor (every weight a step reads, read once at the measured streaming-read bandwidth). Part 4
(`--read_ahead`, where the CPU kernel runs) times whole decodes of plain decoding and each
method under each of the kernel's read-ahead budgets, alternating in one process. These numbers
decide the tree budget on a given machine. Everything is compiled and warmed up before it is
timed; reported times are medians.

`--target=random:NAME` profiles a published architecture (`pspec_jax.presets.ARCHITECTURES`:
llama2_7b, llama2_13b, llama3_8b, ...) with random weights made on the device, on random
prompts of `--prompt_tokens` tokens: no checkpoint needed. Its rounds accept next to nothing,
which changes what a round contains but not what its parts cost.
"""

import dataclasses
import functools
import statistics

import jax
import numpy as np
from absl import flags

from infer import measure
from pspec_jax import checkpoints, cli, cpu_kernel, decode, drafter_files, llama
from pspec_jax import prompts as prompts_lib
from pspec_jax.presets import ARCHITECTURES

FLAGS = flags.FLAGS


def verify_cost(target, drafter, ids, cfg, nodes, repeats):
  """Median ms of one verification pass per tree size, and of one plain decoding round."""
  tokens, lengths = prompts_lib.pad_batch([ids])
  key = jax.random.key(0)
  width = tokens.shape[1]
  plain = decode.make_plan(cfg, None, width)
  state = decode.init(plain, target, None, tokens, lengths, key)
  ar_ms = measure.median_ms(decode.round_step, plain, target, None, state, repeats=repeats)
  out = {}
  for n in nodes:
    tree_cfg = dataclasses.replace(cfg, tree="chain" if n == 1 else f"sparse{n}")
    d = None if n == 1 else drafter
    plan = decode.make_plan(tree_cfg, d, width)
    state = decode.init(plan, target, d, tokens, lengths, key)
    out[n] = measure.median_ms(decode.verify, plan, target, d, state, repeats=repeats)
  return ar_ms, out


READ_AHEAD_TURNS = 5  # part 4's turns


def read_ahead_costs(target, drafters: dict, prompts, cfg, budgets, turns=READ_AHEAD_TURNS):
  """Ms per round of whole decodes (`measure.round_seconds`, the median over `prompts`) for
  each named drafter (None: plain decoding) under each of the CPU kernel's read-ahead budgets
  (bytes), the budgets alternating in order and reverse over `turns`: {name: {budget: [ms per
  turn]}}. The kernel's budget is restored after."""
  out = {name: {b: [] for b in budgets} for name in drafters}
  before = cpu_kernel.read_ahead()
  try:
    for turn in range(turns):
      for budget in budgets if turn % 2 == 0 else budgets[::-1]:
        cpu_kernel.read_ahead(budget)
        for name, drafter in drafters.items():
          seconds = [
            measure.round_seconds(target, drafter, ids, cfg, repeats=2)[0] for ids in prompts
          ]
          out[name][budget].append(1e3 * statistics.median(seconds))
  finally:
    cpu_kernel.read_ahead(before)
  return out


RANDOM = "random:"


def random_target(name: str, dtype, weight_layout: str, seed: int = 0):
  """A target of the published architecture `name` with random weights, made on the device,
  laid out as the decoding programs load a real one: per-layer weights, a tied LM head as its
  own [D, V] array (`checkpoints.load_target(..., untie_head=True)`), in `weight_layout`."""
  if name not in ARCHITECTURES:
    raise ValueError(f"unknown architecture {name!r}: known are {', '.join(ARCHITECTURES)}")
  cfg = llama.LlamaConfig(
    name=f"random-{name}",
    **(ARCHITECTURES[name] | dict(tie_embeddings=False)),
    scan_layers=False,
    dtype=dtype,
    param_dtype=dtype,
  )
  params = jax.jit(functools.partial(llama.init_params, cfg))(jax.random.key(seed))
  if weight_layout == "decode":
    weight_layout = checkpoints.decode_layout()
  return llama.Target(cfg=cfg, params=params).with_weight_layout(weight_layout)


def load(
  spec: str, dtype, weight_layout: str, num_prompts: int, prompt_tokens: int, gguf_blocks=True
):
  """The target, its encoded prompts (MT-Bench first turns, or random ids for a random target)
  and its EOS ids."""
  if spec.startswith(RANDOM):
    target = random_target(spec.removeprefix(RANDOM), dtype, weight_layout)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, target.cfg.vocab_size, (num_prompts, prompt_tokens)).tolist()
    return target, ids, ()
  tokenizer = checkpoints.load_tokenizer(spec)
  prompts = prompts_lib.prompt_set("mt_bench", num_prompts)
  encoded = measure.encode_prompts(tokenizer, prompts, source="mt_bench", count=num_prompts)
  target = checkpoints.load_target(
    spec,
    dtype=dtype,
    param_dtype=dtype,
    scan_layers=False,
    untie_head=True,
    weight_layout=weight_layout,
    gguf_blocks=gguf_blocks,
  )
  return target, encoded, checkpoints.eos_token_ids(spec, tokenizer)


def main():
  if FLAGS.tree.startswith("adaptive"):
    raise ValueError(
      "--tree: an adaptive round runs whole, not phase by phase; its candidates' costs: "
      "python -m infer.calibrate"
    )
  dtype = jax.numpy.dtype(FLAGS.dtype)
  target, encoded, eos_ids = load(
    FLAGS.target,
    dtype,
    FLAGS.weight_layout,
    FLAGS.num_prompts,
    FLAGS.prompt_tokens,
    FLAGS.gguf_blocks,
  )
  cfg = decode.DecodeConfig(
    max_new_tokens=FLAGS.max_new_tokens,
    eos_ids=eos_ids,
    num_draft=FLAGS.num_draft,
    tree=FLAGS.tree,
  )
  print(
    f"# Round profile: {FLAGS.target}, {FLAGS.dtype}, {target.cfg.weight_layout} weights"
    f"{' (GGUF blocks)' if target.keeps_blocks else ''}, "
    f"K={FLAGS.num_draft}, tree {FLAGS.tree}"
  )
  print(f"{jax.devices()[0].device_kind} ({jax.default_backend()})\n")
  print(
    "| method | rounds | draft ms | verify ms | accept+commit ms | draft / verify / a+c "
    "| sum ms | while_loop ms per round | while_loop / sum |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  # Both timings decode every prompt to max_new_tokens (EOS off), so they cover the same rounds.
  timed_cfg = dataclasses.replace(cfg, eos_ids=())
  drafters = {"none": None}  # part 4's, each method's as part 1 resolves it
  for method in FLAGS.methods:
    spec = None if method in ("none", "pld") else FLAGS.drafter
    drafter = drafter_files.resolve_drafter(method, spec, target, num_draft=FLAGS.num_draft)
    drafters[method] = drafter
    ms, rounds = measure.phase_split(target, drafter, encoded, timed_cfg)
    total = sum(ms.values())
    shares = " / ".join(f"{100 * ms[k] / total:.0f}%" for k in ms)
    loop_s = statistics.median(
      measure.round_seconds(target, drafter, ids, timed_cfg)[0] for ids in encoded
    )
    print(
      f"| {method} | {rounds} | {ms['draft']:.2f} | {ms['verify']:.2f} | "
      f"{ms['accept+commit']:.2f} | {shares} | {total:.2f} | {1e3 * loop_s:.2f} | "
      f"{1e3 * loop_s / total:.2f} |",
      flush=True,
    )
  nodes = [int(n) for n in FLAGS.nodes]
  drafter = drafter_files.resolve_drafter("pspec", "random", target, num_draft=FLAGS.num_draft)
  ar_ms, verify_ms = verify_cost(
    target, drafter, encoded[0], dataclasses.replace(cfg, max_new_tokens=8), nodes, FLAGS.repeats
  )
  print(f"\nOne auto-regressive round (verify + commit of the root alone): {ar_ms:.2f} ms\n")
  print("| nodes N | verify ms | / AR round |")
  print("|---|---|---|")
  for n, ms in verify_ms.items():
    print(f"| {n} | {ms:.2f} | {ms / ar_ms:.2f} |", flush=True)
  step = measure.step_profile(target, encoded[0], cfg)
  print(
    f"\nPlain decode step (rounds in the while_loop) {step['decode_step_ms']:.2f} ms; "
    f"memory-bandwidth floor {step['bandwidth_floor_ms']:.2f} ms "
    f"({step['weight_bytes'] / 1e9:.2f} GB of weights / measured read bandwidth "
    f"{step['weight_bytes'] / step['bandwidth_floor_ms'] / 1e6:.0f} GB/s): "
    f"step / floor {step['step_over_floor']:.2f}, the median of each timing turn's own ratio."
  )
  budgets = [int(b) for b in FLAGS.read_ahead]
  if not budgets:
    return
  if not cpu_kernel.available():
    print("\nRead-ahead: no CPU kernel here, nothing to compare.")
    return
  costs = read_ahead_costs(target, drafters, encoded[:2], timed_cfg, budgets)
  print(
    f"\nRead-ahead (the CPU kernel's budget in bytes, alternating in this process over "
    f"{READ_AHEAD_TURNS} turns; "
    f"ms per round of whole decodes, tree {FLAGS.tree}; in brackets the median of each turn's "
    f"ratio to {budgets[0]} bytes):\n"
  )
  print("| method | " + " | ".join(f"{b} bytes" for b in budgets) + " |")
  print("|---|" + "---|" * len(budgets))
  for name, by_budget in costs.items():
    base = by_budget[budgets[0]]
    ratios = [[a / b for a, b in zip(ms, base, strict=True)] for ms in by_budget.values()]
    cells = [
      f"{statistics.median(ms):.2f} ({statistics.median(r):.3f})"
      for ms, r in zip(by_budget.values(), ratios, strict=True)
    ]
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  flags.DEFINE_string(
    "target",
    "smollm2-135m-instruct",
    "Target name, HF directory, .gguf file, or random:ARCH (random weights: random:llama2_7b).",
  )
  flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "The target's weights and compute."
  )
  flags.DEFINE_enum(
    "weight_layout",
    "decode",
    ["decode", "plain", "panels"],
    "How dense weights are stored: `decode` is the fastest layout for this device.",
  )
  flags.DEFINE_integer("prompt_tokens", 128, "Prompt length for a random target.")
  flags.DEFINE_bool(
    "gguf_blocks",
    True,
    "In the decode layout with the CPU kernel, keep a GGUF target's Q4_1 and Q8_0 blocks "
    "(`pspec_jax.panels`); --nogguf_blocks: float32 panels of the same weights.",
  )
  flags.DEFINE_list("methods", ["pspec", "pld"], "Drafting methods to split into phases.")
  flags.DEFINE_string("drafter", "random", "Drafter directory, or `random` (untrained, seeded).")
  flags.DEFINE_integer("num_draft", 4, "K, draft tokens per round.")
  flags.DEFINE_string("tree", "chain", "Tree for part 1: chain, sparseN, dynamic:N or paths:...")
  flags.DEFINE_list("nodes", ["1", "2", "4", "8", "16", "32", "64"], "Tree sizes N for part 2.")
  flags.DEFINE_integer("num_prompts", 4, "MT-Bench prompts (first turns).")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt in part 1.")
  flags.DEFINE_integer("repeats", 20, "Timed verification passes per tree size in part 2.")
  flags.DEFINE_list(
    "read_ahead",
    [],
    "Part 4, where the CPU kernel runs: its read-ahead budgets in bytes to compare (e.g. "
    "0,1048576), plain decoding and each method's rounds; empty: skipped.",
  )


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
