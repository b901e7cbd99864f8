"""Tiny models and prompts the tests share (as gemma's `gm/testing`): import this module
(`from pspec_jax import testing`), never another test file.

`save_hf_llama` imports torch (the `test` extra) and transformers when it is called: the rest of
this module imports without torch, and without the seconds transformers takes to import.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pspec_jax import decode, llama
from pspec_jax import drafter as drafter_lib
from pspec_jax.sampling import SamplingConfig, filtered_logits

__all__ = [
  "HF_CONFIGS",
  "PROMPTS",
  "SAMPLING_TINY",
  "TINY",
  "assert_matches_joint",
  "drafter_for",
  "exact_joint",
  "gguf_block_matmul",
  "gguf_blocks",
  "make_target",
  "padded",
  "sample_many",
  "save_gguf_llama",
  "save_hf_llama",
]

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
  """A random target of `cfg` with its matrices scaled by `scale` (unscanned layers)."""
  params = llama.init_params(cfg, jax.random.key(seed))
  params = jax.tree.map(lambda x: x * scale if x.ndim > 2 else x, params)
  return llama.Target(cfg=cfg, params=params).with_scan_layers(False)


def padded(prompts, width=16):
  """Right-padded [B, width] tokens and [B] lengths."""
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, p in enumerate(prompts):
    tokens[row, : len(p)] = p
  return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def drafter_for(kind, target, num_draft=4, seed=1, **options):
  """A random (untrained) drafter of `kind`, or pld; `options` are more `DrafterConfig` fields
  (`feature_layers`, `num_layers`, `mask_input`, ...)."""
  if kind == "pld":
    cfg = drafter_lib.DrafterConfig.for_target("pld", target.cfg, num_draft=num_draft, **options)
    return drafter_lib.Drafter(cfg=cfg, params={})
  key = jax.random.key(seed)
  return drafter_lib.random_drafter(kind, target, key, num_draft=num_draft, **options)


# Sampling checks: a target whose vocabulary is small enough that every continuation of a few
# tokens can be enumerated, its exact distribution over them, and many decodes to compare.
SAMPLING_TINY = TINY.replace(vocab_size=6, max_position_embeddings=64)


def exact_joint(target, prompt, length, sampling=None):
  """Exact probability of every continuation of `length` tokens after `prompt` under the target
  with `sampling`'s temperature and filters (default T = 1, unfiltered): [V**length], the
  continuations in base-V order (first token most significant)."""
  sampling = sampling or SamplingConfig(temperature=1.0)
  v = target.cfg.vocab_size
  seqs = np.array(np.meshgrid(*[np.arange(v)] * length, indexing="ij")).reshape(length, -1).T
  full = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
  positions = jnp.broadcast_to(jnp.arange(full.shape[1]), full.shape)
  features, _ = target(jnp.asarray(full), positions)
  logp = jax.nn.log_softmax(filtered_logits(target.logits(features), sampling), axis=-1)
  n = len(prompt)
  steps = [logp[np.arange(len(seqs)), n - 1 + i, seqs[:, i]] for i in range(length)]
  return np.exp(np.asarray(sum(steps), np.float64))


def sample_many(target, drafter, prompt, cfg, batch, num_samples):
  """`num_samples` continuations of `prompt`, decoded `batch` at a time (the sequences of one
  batch are independent samples: each one's tokens follow the target given its own prefix,
  whatever the others'): (tokens [num_samples, max_new_tokens], mean tau, mean depth-1
  acceptance per round). Batches of one or a few are vmapped over keys; there a `lax.switch`
  runs every branch, so trees that switch (adaptive, gated, lookup) sample faster in one large
  batch.

  Tens of thousands of decodes take longer to run than to compile, so this program is compiled
  at LLVM's -O1 whatever the session's flags (the test session's -O0 compiles faster and runs
  2.5x slower: one such check took 20 s at -O0 and 13 s at -O1)."""
  tokens, lengths = padded([prompt] * batch, width=8)

  def one(key):
    out = decode.generate(target, tokens, lengths, key, cfg, drafter)
    depth1 = out.accepted_per_depth[:, :1].sum(-1)  # none without a drafter
    return out.tokens, out.tau, depth1 / jnp.maximum(out.rounds, 1)

  @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 1})
  def run(keys):
    return jax.lax.map(one, keys, batch_size=max(1, 1000 // batch))

  out, tau, depth1 = run(jax.random.split(jax.random.key(123), num_samples // batch))
  return np.asarray(out).reshape(num_samples, -1), float(tau.mean()), float(depth1.mean())


def assert_matches_joint(samples, probs, vocab_size, min_cells=10):
  """Chi-square test of sampled continuations (rows of token ids) against their exact
  probabilities (`exact_joint`); continuations of probability 0 must never appear."""
  import scipy.stats

  codes = samples @ (vocab_size ** np.arange(samples.shape[1] - 1, -1, -1))
  observed = np.bincount(codes, minlength=len(probs)).astype(np.float64)
  assert observed[probs == 0].sum() == 0  # filtered continuations never appear
  expected = probs * len(samples)
  rare = expected < 5  # pooled into one cell so that every expected count is >= 5
  observed = np.append(observed[~rare & (probs > 0)], observed[rare & (probs > 0)].sum())
  expected = np.append(expected[~rare & (probs > 0)], expected[rare & (probs > 0)].sum())
  if expected[-1] == 0:
    observed, expected = observed[:-1], expected[:-1]
  assert len(expected) > min_cells
  _, p_value = scipy.stats.chisquare(observed, expected * observed.sum() / expected.sum())
  assert p_value > 1e-3, p_value


# HF Llama variants for `save_hf_llama`: grouped and full attention, tied and untied heads, and
# Llama 3's RoPE scaling with a head width other than hidden / heads.
HF_CONFIGS = {
  "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
  "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
  "llama3_scaling_wide_heads": dict(
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling=dict(
      rope_type="llama3",
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=16,
    ),
  ),
}


def save_hf_llama(directory, seed=0, dtype=None, **overrides):
  """A tiny random HF Llama saved with `save_pretrained`; returns the torch model.

  Args:
    directory: where to save it.
    seed: torch's seed for its weights.
    dtype: a torch dtype for the saved weights (default float32).
    **overrides: `transformers.LlamaConfig` fields, e.g. one of `HF_CONFIGS`.
  """
  import torch  # see the module docstring
  import transformers

  torch.manual_seed(seed)
  config = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    max_position_embeddings=256,
    initializer_range=0.2,
    **overrides,
  )
  model = transformers.LlamaForCausalLM(config).to(dtype or torch.float32).eval()
  model.save_pretrained(directory)
  return model


def gguf_blocks(rng, kind: str, k: int, n: int, scale: float = 1.0):
  """A random [K, N] weight quantised as a GGUF file stores it (`kind`: a GGML type name):
  its N rows of blocks along K (uint8), and their dequantisation [K, N] float32."""
  import gguf

  qtype = gguf.GGMLQuantizationType[kind]
  raw = gguf.quants.quantize((scale * rng.standard_normal((n, k))).astype(np.float32), qtype)
  return raw, np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(n, k).T


def gguf_block_matmul(x_MK, raw, kind: str, k: int, n: int) -> np.ndarray:
  """x @ W [M, n] float32 as the CPU kernel multiplies a GGUF weight's blocks (`raw`, as
  `gguf_blocks` gives them), written out in numpy: x quantised to 8 bits per 32 k, exact
  integer sums per block, then y += (d dx) isum (+ m sx) per block in K order, each rounded
  once (computed in float64: within one float32 rounding of the kernel's fused multiply-add)."""
  nb = k // 32
  b = np.asarray(raw, np.uint8).reshape(n, nb, -1)
  half = lambda part: np.ascontiguousarray(part).view(np.float16)[..., 0].astype(np.float32)
  d = half(b[..., 0:2])
  if kind == "Q4_1":
    m, qs = half(b[..., 2:4]), b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
  else:
    m, q = None, b[..., 2:].view(np.int8).astype(np.int64)
  x = np.asarray(x_MK, np.float32).reshape(-1, nb, 32)
  dx = np.abs(x).max(-1) / np.float32(127)
  inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
  qx = np.rint(x * inv[..., None]).astype(np.int64)
  sx = dx * qx.sum(-1).astype(np.float32)
  isum = np.einsum("Mbi,nbi->Mnb", qx, q)
  y = np.zeros((x.shape[0], n), np.float32)
  f64 = lambda a: np.asarray(a, np.float64)
  for j in range(nb):
    t = d[None, :, j] * dx[:, j, None]
    y = (f64(t) * f64(isum[..., j]) + f64(y)).astype(np.float32)
    if m is not None:
      y = (f64(m[None, :, j]) * f64(sx[:, j, None]) + f64(y)).astype(np.float32)
  return y


def save_gguf_llama(path, seed=0, dense="Q4_1", embedding="Q8_0", tied=True, scale=3.0):
  """A small random Llama as a GGUF file, its dense weights and embedding block-quantised
  (`dense`, `embedding`: GGML type names), K and N on and off multiples of 64 and 32."""
  import gguf

  rng = np.random.default_rng(seed)
  d, f, heads, kv_heads, vocab, num_layers = 64, 96, 4, 2, 130, 2
  h = d // heads
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(num_layers)
  writer.add_context_length(256)
  writer.add_embedding_length(d)
  writer.add_feed_forward_length(f)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_freq_base(10000.0)

  def quantised(name, kind, k, n, scale):
    raw, _ = gguf_blocks(rng, kind, k, n, scale)
    writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

  def norm(name):
    writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))

  quantised("token_embd.weight", embedding, d, vocab, 1.0)
  for i in range(num_layers):
    norm(f"blk.{i}.attn_norm.weight")
    norm(f"blk.{i}.ffn_norm.weight")
    for name, k, n in (
      ("attn_q", d, heads * h),
      ("attn_k", d, kv_heads * h),
      ("attn_v", d, kv_heads * h),
      ("attn_output", heads * h, d),
      ("ffn_gate", d, f),
      ("ffn_up", d, f),
      ("ffn_down", f, d),
    ):
      quantised(f"blk.{i}.{name}.weight", dense, k, n, scale / np.sqrt(k))
  norm("output_norm.weight")
  if not tied:
    quantised("output.weight", embedding, d, vocab, scale / np.sqrt(d))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


# The command-line tests: the repository root they run in, the smoke training config, and the
# environment of a CPU subprocess (no fake devices, no hub).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = "configs/smollm2_135m.py:smoke"


def cli_env(devices: int = 1) -> dict:
  """The environment of a program a test starts: the CPU (`devices` of them), XLA's default
  flags, no hub. Every program it compiles goes to the persistent compilation cache, not only
  those that took a second or more: the next program finds them there (a real-model run 11.4 s
  instead of 12.5)."""
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}" if devices > 1 else "",
    HF_HUB_OFFLINE="1",
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
  )


class CharTokenizer:
  """One token per character and a ChatML-like template: enough to check rendering."""

  name_or_path = "chars"
  pad_token_id = 0

  def __len__(self):
    return 256

  def __call__(self, text, add_special_tokens=False):
    class Out:
      input_ids = [ord(c) % 256 for c in text]

    return Out()

  def apply_chat_template(self, turns, add_generation_prompt=False, tokenize=False):
    text = "".join(f"<{t['role'][0]}>{t['content']}|" for t in turns)
    return text + ("<a>" if add_generation_prompt else "")
