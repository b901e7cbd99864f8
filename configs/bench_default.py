r"""Benchmark of the embedded default on MT-Bench, greedy, batch 1, 2 CPU threads.

  python -m infer.bench                                  # this config
  python -m infer.bench --config.num_prompts=20 --config.max_new_tokens=256
  python -m infer.bench --config=configs/bench_default.py:smoke

Runs in a few minutes on a 2-core CPU; writes results.json and report.md under bench_results/.
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = "smollm2-135m-instruct"
  config.methods = "none,hf"  # comma-separated; `hf` is HF transformers' PyTorch generate
  config.datasets = "mt_bench"
  config.num_prompts = 8
  config.max_new_tokens = 128
  config.temperature = 0.0
  config.batch_size = 1
  config.torch_threads = 2
  config.out = ""  # default: bench_results/<timestamp>
  if variant == "smoke":
    config.num_prompts = 2
    config.max_new_tokens = 8
  elif variant is not None:
    raise ValueError(f"unknown variant {variant!r} of bench_default (known: smoke)")
  return config
