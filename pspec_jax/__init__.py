"""pspec_jax: ParallelSpec speculative decoding for Llama-family targets in JAX/Flax.

  from pspec_jax import checkpoints, decode, drafter_files
  target = checkpoints.load_target("smollm2-135m-instruct", scan_layers=False, untie_head=True)
  drafter = drafter_files.load_drafter("path/to/drafter", target)  # or None: plain decoding
  out = decode.generate(target, prompt_tokens, prompt_lengths, jax.random.key(0),
                        decode.DecodeConfig(max_new_tokens=64, tree="sparse16"), drafter)

Shape suffixes used throughout (`logits_BTV`, `kv_LBSKH`, einsum strings alike):
  B batch          T query (new token) length   S cache length    U keys of the new tokens
  D model width    N query heads                K kv heads        G query heads per kv head
  H head dim       F MLP width                  V vocab           L layers
  P draft depth    M tree nodes
"""

import os

__version__ = "0.1.0"


def cache_dir(name: str) -> str:
  """Where pspec_jax keeps what it computes once and reads back (`tokenizers` built from GGUF
  files, tokenised training `data` and target features): `$PSPEC_JAX_CACHE/name`, by default
  under ~/.cache/pspec_jax."""
  root = os.environ.get("PSPEC_JAX_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "pspec_jax"
  )
  return os.path.join(root, name)
