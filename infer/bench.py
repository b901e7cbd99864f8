r"""Decoding speed of each method on a real prompt set, measured as ratios in one run.

  python -m infer.bench                               # configs/bench_default.py
  python -m infer.bench --config.num_prompts=20 --config.methods=none,hf

Every method is compiled and warmed up first; then methods are interleaved prompt by prompt,
so machine noise hits all of them alike. At temperature 0 every method's tokens are compared
with `none`'s (the lossless check). Also reported: our time per decode step against the
memory-bandwidth floor (weight bytes / measured copy bandwidth).

Methods today: `none` (our jitted auto-regressive decoder) and `hf` (HF transformers' PyTorch
`generate` on the same float32 weights, when torch is installed).
"""

import datetime
import json
import os
import platform
import statistics
import sys
import time

from absl import app, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", os.path.join(os.path.dirname(__file__), "..", "configs", "bench_default.py")
)
KNOWN_METHODS = ("none", "hf")


class OurDecoder:
  """`none`: pspec_jax's plain decoding."""

  def __init__(self, target, cfg):
    self.target, self.cfg = target, cfg

  def __call__(self, ids: list[int]) -> list[int]:
    import jax
    import numpy as np

    from pspec_jax import data, decode

    tokens, lengths = data.pad_batch([ids])
    out = decode.generate(self.target, tokens, lengths, jax.random.key(0), self.cfg)
    out = jax.device_get(out)
    return np.asarray(out.tokens[0, : out.lengths[0]]).tolist()


class HFDecoder:
  """`hf`: HF transformers' `generate` (PyTorch, float32) on the same GGUF/HF weights."""

  def __init__(self, spec, cfg, threads):
    import torch
    import transformers

    from pspec_jax import checkpoints

    torch.set_num_threads(threads)
    source = checkpoints.resolve_target(spec)
    if source.kind == "gguf":
      directory, filename = os.path.split(source.path)
      kwargs = dict(gguf_file=filename)
    else:
      directory, kwargs = source.path, {}
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=torch.float32, **kwargs
    ).eval()
    self.cfg = cfg

  def __call__(self, ids: list[int]) -> list[int]:
    import torch

    sampling = self.cfg.sampling
    with torch.inference_mode():
      out = self.model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=self.cfg.max_new_tokens,
        do_sample=not sampling.greedy,
        temperature=sampling.temperature or None,
        top_k=sampling.top_k or None,
        top_p=sampling.top_p,
        eos_token_id=list(self.cfg.eos_ids),
        pad_token_id=self.cfg.eos_ids[0],
      )
    return out[0, len(ids) :].tolist()


def copy_bandwidth(num_bytes: int, repeats: int = 5) -> float:
  """Bytes per second of a plain memory copy of `num_bytes` (median of a few)."""
  import numpy as np

  src = np.ones(num_bytes // 4, np.float32)
  dst = np.empty_like(src)
  times = []
  for _ in range(repeats):
    began = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - began)
  return num_bytes / statistics.median(times)


def decode_step_seconds(target, ids, cfg, steps=64, repeats=3) -> float:
  """Time of one decode step: (generate steps+1 tokens - generate 1 token) / steps.

  EOS is disabled so both runs do exactly that many steps; the difference cancels prefill.
  """
  import dataclasses

  long_cfg = dataclasses.replace(cfg, max_new_tokens=steps + 1, eos_ids=())
  short_cfg = dataclasses.replace(cfg, max_new_tokens=1, eos_ids=())
  long_run, short_run = OurDecoder(target, long_cfg), OurDecoder(target, short_cfg)
  long_run(ids), short_run(ids)  # compile
  diffs = []
  for _ in range(repeats):
    began = time.perf_counter()
    long_run(ids)
    middle = time.perf_counter()
    short_run(ids)
    diffs.append((middle - began) - (time.perf_counter() - middle))
  return statistics.median(diffs) / steps


def run(config) -> dict:
  import jax
  import transformers
  from tqdm import tqdm

  from pspec_jax import checkpoints, data, decode
  from pspec_jax.sampling import SamplingConfig

  transformers.logging.set_verbosity_error()
  methods = [m.strip() for m in config.methods.split(",") if m.strip()]
  unknown = sorted(set(methods) - set(KNOWN_METHODS))
  if unknown or not methods:
    raise ValueError(f"unknown methods {unknown}: known are {', '.join(KNOWN_METHODS)}")
  if config.batch_size != 1:
    raise ValueError("only batch_size=1 is measured so far")
  if config.datasets != "mt_bench":
    raise ValueError(f"unknown datasets {config.datasets!r}: known is mt_bench")

  tokenizer = checkpoints.load_tokenizer(config.target)
  prompts = data.read_prompts(data.prompt_set_path("mt_bench"))[: config.num_prompts]
  chat = tokenizer.chat_template is not None
  encoded = [data.encode_prompt(tokenizer, p, chat) for p in prompts]
  target = checkpoints.load_target(config.target, scan_layers=False)
  cfg = decode.DecodeConfig(
    max_new_tokens=config.max_new_tokens,
    sampling=SamplingConfig(temperature=config.temperature),
    eos_ids=checkpoints.eos_token_ids(config.target, tokenizer),
  )
  runners = {}
  for method in methods:
    if method == "none":
      runners[method] = OurDecoder(target, cfg)
    else:
      runners[method] = HFDecoder(config.target, cfg, config.torch_threads)

  # Compile every prompt bucket and warm up every method before anything is timed.
  for runner in runners.values():
    for ids in {len(data.pad_batch([ids])[0][0]): ids for ids in encoded}.values():
      runner(ids)
  records = {m: [] for m in methods}
  for ids in tqdm(encoded, desc="prompts", file=sys.stderr):
    for method, runner in runners.items():
      began = time.perf_counter()
      out = runner(ids)
      records[method].append(dict(seconds=time.perf_counter() - began, tokens=out))

  def tokens_per_s(method):
    rs = records[method]
    return sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs)

  rows = []
  for method in methods:
    lossless = None
    if config.temperature == 0 and "none" in records:
      lossless = all(
        a["tokens"] == b["tokens"] for a, b in zip(records[method], records["none"], strict=True)
      )
    rows.append(
      dict(
        method=method,
        dataset=config.datasets,
        temperature=config.temperature,
        batch_size=config.batch_size,
        num_draft=0,
        tree="",
        tokens_per_s=tokens_per_s(method),
        speedup=tokens_per_s(method) / tokens_per_s("none") if "none" in records else None,
        tau=1.0,
        accept_per_depth=[],
        draft_share=0.0,
        verify_share=1.0,
        lossless=lossless,
        num_prompts=len(encoded),
        tokens=sum(len(r["tokens"]) for r in records[method]),
        median_seconds_per_prompt=statistics.median(r["seconds"] for r in records[method]),
      )
    )
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
  step = decode_step_seconds(target, encoded[0], cfg)
  floor = weight_bytes / copy_bandwidth(weight_bytes)
  meta = dict(
    machine=platform.platform(),
    processor=platform.processor() or platform.machine(),
    cpu_count=os.cpu_count(),
    devices=[str(d) for d in jax.devices()],
    jax_version=jax.__version__,
    target=config.target,
    drafters={},
    config=config.to_dict(),
    weight_bytes=weight_bytes,
    decode_step_ms=step * 1e3,
    bandwidth_floor_ms=floor * 1e3,
    step_over_floor=step / floor,
  )
  return dict(meta=meta, rows=rows)


def report(results: dict) -> str:
  meta, rows = results["meta"], results["rows"]
  lines = [
    f"# Decoding benchmark: {meta['target']}",
    "",
    f"{meta['machine']}, {meta['cpu_count']} CPUs, devices {', '.join(meta['devices'])}, "
    f"jax {meta['jax_version']}.",
    "",
    "| method | dataset | T | tokens/s | speedup vs none | tau | lossless |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    lines.append(
      f"| {r['method']} | {r['dataset']} | {r['temperature']} | {r['tokens_per_s']:.1f} | "
      f"{speedup} | {r['tau']:.2f} | {r['lossless']} |"
    )
  lines += [
    "",
    f"Decode step {meta['decode_step_ms']:.1f} ms; memory-bandwidth floor "
    f"{meta['bandwidth_floor_ms']:.1f} ms ({meta['weight_bytes'] / 1e6:.0f} MB of weights / "
    f"measured copy bandwidth): ratio {meta['step_over_floor']:.2f}.",
  ]
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  try:
    results = run(config)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  out = config.out or os.path.join(
    "bench_results", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  )
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as fh:
    json.dump(results, fh, indent=2)
  text = report(results)
  with open(os.path.join(out, "report.md"), "w") as fh:
    fh.write(text)
  print(text)
  print(f"results in {out}/")


if __name__ == "__main__":
  app.run(main)
