"""The tiny random target the decoding tests share, and helpers to feed it."""

import jax
import jax.numpy as jnp
import numpy as np

from pspec_jax import drafter as drafter_lib
from pspec_jax import llama

# A small vocabulary makes random drafters right now and then, so acceptance paths run; scaled
# weights make the target's distributions peaked (and greedy decoding repetitive).
TINY = llama.LlamaConfig(
  name="tiny",
  vocab_size=16,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  max_position_embeddings=256,
)
PROMPTS = [[5, 9, 2, 13, 7], [1, 2], [10, 11, 12, 13, 14, 15, 3, 4, 8], [6]]


def make_target(scale, seed=0, cfg=TINY):
  params = llama.init_params(cfg, jax.random.key(seed))
  params = jax.tree.map(lambda x: x * scale if x.ndim > 2 else x, params)
  return llama.Target(cfg=cfg, params=params).with_scan_layers(False)


def padded(prompts, width=16):
  """Right-padded [B, width] tokens and [B] lengths."""
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, p in enumerate(prompts):
    tokens[row, : len(p)] = p
  return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def drafter_for(kind, target, num_draft=4, seed=1):
  """A random (untrained) drafter of `kind`, or pld."""
  if kind == "pld":
    cfg = drafter_lib.DrafterConfig.for_target("pld", target.cfg, num_draft=num_draft)
    return drafter_lib.Drafter(cfg=cfg, params={})
  return drafter_lib.random_drafter(kind, target, jax.random.key(seed), num_draft=num_draft)
