r"""Benchmark of the embedded default: every method on MT-Bench, greedy, batch 1, on a CPU.

  python -m infer.bench                                       # this config (< 10 min, 2 cores)
  python -m infer.bench --config.datasets=mt_bench,humaneval,sharegpt --config.num_prompts=20
  python -m infer.bench --config=configs/bench_default.py:ablation   # K = 1..4, chain and sparse8
  python -m infer.bench --config=configs/bench_default.py:smoke      # seconds; tests
  python -m infer.bench --dry_run --config.target=path/to/Llama-2-13b-chat-hf \
      --config.dtype=bfloat16 --config.hardware=v4-32 --config.mesh=data=4,tensor=4

List-valued keys take comma-separated values: `--config.temperature=0,1`.
Writes results.json, report.md and plots under bench_results/<timestamp>/ (or `out`).
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = "smollm2-135m-instruct"
  # none, pld, medusa, eagle, pspec (pspec_jax); hf, hf_pld (HF transformers' generate).
  config.methods = "none,pld,medusa,eagle,pspec,hf,hf_pld"
  config.datasets = "mt_bench"  # mt_bench, humaneval, sharegpt (the held-out split)
  config.num_prompts = 8
  config.max_prompt_tokens = 512  # longer prompts of a set are passed over
  config.max_new_tokens = 128
  # Each prompt is decoded this many times by every setting in turn, and timed by the median:
  # one decode on a shared machine can take tens of percent longer than the next.
  config.turns = 3
  config.temperature = "0"  # list
  # Sampled rows (T > 0) decode max_new_tokens from each prompt, past EOS, unless this is True:
  # a sampled answer's length is a random draw, another for each method, and one that stopped
  # early carries more of its prompt's prefill per token (with 4 prompts at T = 1, one method's
  # answers came to 280 tokens and `none`'s to 512, and its tokens/s read a fifth low). Greedy
  # rows stop at EOS: every method gives the same tokens.
  config.sampled_eos = False
  config.batch_size = "1"  # list
  config.num_draft = ""  # list of K; "" is each drafter's own
  # list of trees (chain, sparseN, dynamic:N, paths:..., each with optional +min:P and +lookup:L;
  # adaptive; fixed, each drafter's fixed tree); "" is each drafter's default
  config.tree = ""
  # list: at T > 0, drafts drawn from the drafter's q ("sampled", accepted by speculative
  # sampling) and/or its top-k tokens ("top_k", the deterministic rule); both compare the two
  config.drafts = "sampled"
  config.drafter_dir = ""  # a directory of <kind>/ drafters; "" is the ones shipped for target
  config.dtype = "float32"  # of the target's weights and compute
  # How the target's and drafters' dense weights are stored: "decode" is the fastest layout for
  # this device (64-column panels on a CPU), or "plain" / "panels" (`pspec_jax.panels`).
  config.weight_layout = "decode"
  # In the decode layout on a CPU with the kernel, a GGUF target's Q4_1 and Q8_0 weights stay in
  # their blocks (`pspec_jax.panels`: the same weights, a fifth of the bytes); False: float32.
  config.gguf_blocks = True
  config.hardware = "cpu"  # what --dry_run plans for: cpu, v4-8, v4-32, v5e-16, gpu-80gb
  config.mesh = ""  # shard over a device mesh, e.g. "data=2,tensor=4"; "" is one device
  config.phase_prompts = 1  # prompts run phase by phase for the draft/verify/commit split
  config.step_profile = True  # `none`'s decode step against the memory-bandwidth floor
  config.torch_threads = 2
  config.seed = 0
  config.out = ""  # default: bench_results/<timestamp>
  if variant == "smoke":
    config.methods = "none,pld,pspec"
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.turns = 1
    config.step_profile = False
  elif variant == "ablation":
    config.methods = "none,pld,eagle,pspec"
    config.num_draft = "1,2,3,4"
    config.tree = "chain,sparse8"
  elif variant is not None:
    raise ValueError(f"unknown variant {variant!r} of bench_default (known: smoke, ablation)")
  return config
