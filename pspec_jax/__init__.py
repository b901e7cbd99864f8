"""pspec_jax: ParallelSpec speculative decoding for Llama-family targets in JAX/Flax.

  import pspec_jax as pj
  target = pj.load_target("smollm2-135m-instruct", weight_layout="decode")
  drafter = pj.resolve_drafter("pspec", None, target)  # or None: plain decoding
  out = pj.generate(target, prompt_tokens, prompt_lengths, jax.random.key(0),
                    pj.DecodeConfig(max_new_tokens=64), drafter)

The names below are the public surface; the modules (`pspec_jax.decode`, `.rounds`, `.llama`,
...) hold the rest, documented in docs/design.md. They are imported on first use, so that
`import pspec_jax` (configs, `--help`) stays fast.

Shape suffixes used throughout (`logits_BTV`, `kv_LBSKH`, einsum strings alike):
  B batch          T query (new token) length   S cache length    U keys of the new tokens
  D model width    N query heads                K kv heads        G query heads per kv head
  H head dim       F MLP width                  V vocab           L layers
  P draft depth    M tree nodes
"""

import importlib
import os

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
  "generate": "decode",
  "stream": "decode",
  "shard": "decode",
  "DecodeConfig": "decode_plan",
  "SamplingConfig": "sampling",
  "load_target": "checkpoints",
  "load_tokenizer": "checkpoints",
  "eos_token_ids": "checkpoints",
  "encode_prompt": "prompts",
  "pad_batch": "prompts",
  "load_drafter": "drafter_files",
  "resolve_drafter": "drafter_files",
  "make_mesh": "sharding",
}
__all__ = ["cache_dir", *_PUBLIC]


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(f"pspec_jax.{_PUBLIC[name]}"), name)
  raise AttributeError(f"module 'pspec_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*__all__, "__version__"])


def cache_dir(name: str) -> str:
  """Where pspec_jax keeps what it computes once and reads back (`tokenizers` built from GGUF
  files, tokenised training `data` and target features): `$PSPEC_JAX_CACHE/name`, by default
  under ~/.cache/pspec_jax."""
  root = os.environ.get("PSPEC_JAX_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "pspec_jax"
  )
  return os.path.join(root, name)
