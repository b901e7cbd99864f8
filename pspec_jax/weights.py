"""Target weights and configs from files: HF checkpoint directories and GGUF files.

Both formats are read into HF's tensor naming and layout (`model.layers.{i}.self_attn.q_proj
.weight`, [out, in]) and converted to our parameter tree by one function, `params_from_hf`.

- HF directories: `config.json` plus `model.safetensors` or shards listed in
  `model.safetensors.index.json`. Safetensors files are memory-mapped from their header (numpy
  has no bfloat16, so `ml_dtypes` supplies it), so tensors are read one at a time.
- GGUF files: the header read by `gguf_file`, the tensors dequantised to float32 by the `gguf`
  package. llama.cpp's converter permutes the rows of q and k for its own RoPE layout; we undo
  it.
"""

import functools
import json
import os
import struct as pystruct
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pspec_jax import gguf_file, panels
from pspec_jax.layers import stack_layers
from pspec_jax.llama import LlamaConfig, RopeScaling

__all__ = [
  "config_from_hf",
  "gguf_config",
  "gguf_reader",
  "gguf_tensors",
  "head_from_embedding",
  "hf_tensors",
  "params_from_hf",
  "read_safetensors",
]


# ---------------------------------------------------------------------------------------------
# Config


def config_from_hf(hf: dict, name: str, **overrides) -> LlamaConfig:
  """LlamaConfig from a HF `config.json` dict (old `rope_scaling` or new `rope_parameters`)."""
  if not isinstance(hf, dict):
    raise ValueError(f"config.json must hold a JSON object, not a {type(hf).__name__}")
  archs = hf.get("architectures") or []
  if hf.get("model_type") != "llama" or any(a != "LlamaForCausalLM" for a in archs):
    raise ValueError(
      f"unsupported architecture {archs or hf.get('model_type')}: only Llama-family "
      "(LlamaForCausalLM) targets are supported"
    )
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"unsupported Llama variant: {flag}=true")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported activation {hf['hidden_act']!r}: Llama uses silu")
  rope = dict(hf.get("rope_parameters") or {})
  rope.update(hf.get("rope_scaling") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ("default", "llama3"):
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r} (default and llama3 are)")
  scaling = None
  if rope_type == "llama3":
    scaling = RopeScaling(
      factor=_hf_value(rope, "factor", float),
      low_freq_factor=_hf_value(rope, "low_freq_factor", float),
      high_freq_factor=_hf_value(rope, "high_freq_factor", float),
      original_max_position_embeddings=_hf_value(rope, "original_max_position_embeddings", int),
    )
  heads = _hf_value(hf, "num_attention_heads", int)
  return LlamaConfig(
    name=name,
    vocab_size=_hf_value(hf, "vocab_size", int),
    hidden_size=_hf_value(hf, "hidden_size", int),
    intermediate_size=_hf_value(hf, "intermediate_size", int),
    num_layers=_hf_value(hf, "num_hidden_layers", int),
    num_heads=heads,
    num_kv_heads=_hf_value(hf, "num_key_value_heads", int, None) or heads,
    head_dim=_hf_value(hf, "head_dim", int, None) or 0,
    rope_theta=_hf_value(rope, "rope_theta", float, _hf_value(hf, "rope_theta", float, 10000.0)),
    rope_scaling=scaling,
    rms_norm_eps=_hf_value(hf, "rms_norm_eps", float, 1e-6),
    tie_embeddings=_hf_value(hf, "tie_word_embeddings", bool, False),
    max_position_embeddings=_hf_value(hf, "max_position_embeddings", int, 4096),
    **overrides,
  )


_REQUIRED = object()


def _hf_value(hf: dict, key: str, kind: type, default=_REQUIRED):
  """`hf[key]` checked to be a `kind` (a float may be written as an int; null is absent)."""
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise ValueError(f"config.json has no {key!r}: a Llama config.json needs it")
    return default
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value, ok = float(value), True
  if not ok:
    raise ValueError(
      f"config.json has {key}={value!r} ({type(value).__name__}), where a Llama config.json "
      f"has {'an' if kind is int else 'a'} {kind.__name__}"
    )
  return value


# ---------------------------------------------------------------------------------------------
# Parameters


def params_from_hf(
  cfg: LlamaConfig, get: Callable[[str], np.ndarray], place: Callable | None = None
) -> dict:
  """Our parameter tree from HF-named tensors in HF's [out, in] layout.

  Tensors are read, converted and placed one at a time (at most one layer is on the host).

  Args:
    cfg: the target architecture; every tensor's shape is checked against it.
    get: returns the tensor of a HF name (numpy, any float dtype); KeyError if absent.
    place: `place(path, array)` puts one converted tensor on its device(s), `path` being its
      key path in the per-layer tree (`("layers_0", "attn", "q")`); default: the default device.
  """
  place = place or (lambda path, x: jnp.asarray(x))
  d, n, k, h, f = (
    cfg.hidden_size,
    cfg.num_heads,
    cfg.num_kv_heads,
    cfg.head_dim,
    cfg.intermediate_size,
  )
  dtype = np.dtype(cfg.param_dtype)

  def tensor(name, shape):
    try:
      x = get(name)
    except KeyError:
      raise ValueError(f"checkpoint has no tensor {name} (does the config match it?)") from None
    if tuple(x.shape) != shape:
      raise ValueError(f"tensor {name} has shape {tuple(x.shape)}, the config expects {shape}")
    return np.asarray(x).astype(dtype)

  def layer(i):
    def get_layer(suffix, shape, convert=lambda x: x):
      return convert(tensor(f"model.layers.{i}.{suffix}.weight", shape))

    return {
      "attn_norm": {"scale": get_layer("input_layernorm", (d,))},
      "mlp_norm": {"scale": get_layer("post_attention_layernorm", (d,))},
      "attn": {
        "q": get_layer("self_attn.q_proj", (n * h, d), lambda x: x.T.reshape(d, n, h)),
        "k": get_layer("self_attn.k_proj", (k * h, d), lambda x: x.T.reshape(d, k, h)),
        "v": get_layer("self_attn.v_proj", (k * h, d), lambda x: x.T.reshape(d, k, h)),
        "o": get_layer("self_attn.o_proj", (d, n * h), lambda x: x.T.reshape(n, h, d)),
      },
      "mlp": {
        "gate": get_layer("mlp.gate_proj", (f, d), lambda x: x.T),
        "up": get_layer("mlp.up_proj", (f, d), lambda x: x.T),
        "down": get_layer("mlp.down_proj", (d, f), lambda x: x.T),
      },
    }

  def placed(prefix, tree):
    return jax.tree_util.tree_map_with_path(
      lambda path, x: place(prefix + tuple(k.key for k in path), x), tree
    )

  params = {
    "embedding": place(("embedding",), tensor("model.embed_tokens.weight", (cfg.vocab_size, d))),
    "norm": {"scale": place(("norm", "scale"), tensor("model.norm.weight", (d,)))},
  }
  # One layer at a time, straight into the layout the config asks for.
  layers = [placed((f"layers_{i}",), layer(i)) for i in range(cfg.num_layers)]
  if cfg.scan_layers:
    params["layers"] = stack_layers(layers)
  else:
    params.update({f"layers_{i}": p for i, p in enumerate(layers)})
  if not cfg.tie_embeddings:
    params["lm_head"] = place(("lm_head",), tensor("lm_head.weight", (cfg.vocab_size, d)).T)
  return params


_SAFETENSORS_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Memory-maps every tensor of one safetensors file (nothing is read until used)."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
      (header_len,) = pystruct.unpack("<Q", fh.read(8))
      if header_len > size - 8:
        raise ValueError("header longer than the file")
      header = json.loads(fh.read(header_len))
    data_start = 8 + header_len
    out = {}
    for name, info in header.items():
      if name == "__metadata__":
        continue
      dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
      begin, end = info["data_offsets"]
      shape = tuple(info["shape"])
      if data_start + end > size or end - begin != dtype.itemsize * int(np.prod(shape)):
        raise ValueError(f"tensor {name} lies outside the file or has the wrong size")
      mm = np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=shape or (1,))
      out[name] = mm.reshape(shape)
    return out
  except (OSError, ValueError, KeyError, pystruct.error, json.JSONDecodeError) as e:
    raise ValueError(f"corrupt safetensors file {path}: {e}") from None


def hf_tensors(directory: str) -> dict[str, np.ndarray]:
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    try:
      with open(index_path) as fh:
        files = sorted(set(json.load(fh)["weight_map"].values()))
    except (ValueError, KeyError) as e:
      raise ValueError(f"corrupt index file {index_path}: {e}") from None
  elif os.path.isfile(os.path.join(directory, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise ValueError(f"{directory} has no model.safetensors nor model.safetensors.index.json")
  tensors = {}
  for name in files:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise ValueError(f"checkpoint file missing: {path}")
    tensors.update(read_safetensors(path))
  return tensors


# ---------------------------------------------------------------------------------------------
# GGUF

_GGUF_LAYER_NAMES = {
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
  "attn_norm": "input_layernorm",
  "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str | None:
  if gguf_name in _GGUF_GLOBAL_NAMES:
    return _GGUF_GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
  return None


def _unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverts llama.cpp's `permute` of q/k rows (interleaved -> HF rotate-half halves)."""
  half = w.shape[0] // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_reader(path: str):
  """The file's parsed header and memory-mapped tensors: the config, the weights and the EOS ids
  of one file share one reader (until the file changes)."""
  try:
    stat = os.stat(path)
  except OSError as e:
    raise ValueError(f"cannot read GGUF file {path}: {e}") from None
  return _parsed_gguf(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed_gguf(path: str, size: int, mtime_ns: int) -> gguf_file.GGUFFile:
  del size, mtime_ns  # the cache key: a rewritten file is parsed again
  try:
    return gguf_file.GGUFFile(path)
  except (ValueError, OSError) as e:
    raise ValueError(f"corrupt GGUF file {path}: {e}") from None


def gguf_config(reader: gguf_file.GGUFFile, name: str, **overrides) -> LlamaConfig:
  arch = reader.fields.get("general.architecture")
  if arch != "llama":
    raise ValueError(f"unsupported GGUF architecture {arch!r}: only llama is supported")
  names = {t.name for t in reader.tensors}

  def get(key, default=None):
    value = reader.fields.get(f"llama.{key}", default)
    if value is None:
      raise ValueError(f"GGUF file lacks the metadata key llama.{key}")
    return value

  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embed is None:
    raise ValueError("GGUF file has no token_embd.weight tensor")
  num_heads = get("attention.head_count")
  hidden = get("embedding_length")
  if reader.fields.get("llama.rope.scaling.type") not in (None, "none"):
    raise ValueError("unsupported GGUF RoPE scaling: only unscaled RoPE is read from GGUF")
  return LlamaConfig(
    name=name,
    vocab_size=int(reader.fields.get("llama.vocab_size", embed.shape[1])),
    hidden_size=hidden,
    intermediate_size=get("feed_forward_length"),
    num_layers=get("block_count"),
    num_heads=num_heads,
    num_kv_heads=get("attention.head_count_kv", num_heads),
    head_dim=get("rope.dimension_count", hidden // num_heads),
    rope_theta=float(get("rope.freq_base", 10000.0)),
    rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
    tie_embeddings="output.weight" not in names,
    max_position_embeddings=get("context_length", 4096),
    **overrides,
  )


def gguf_tensors(reader, cfg: LlamaConfig) -> Callable[[str], np.ndarray]:
  import gguf

  by_hf_name = {}
  for t in reader.tensors:
    hf_name = _hf_name(t.name)
    if hf_name is not None:
      by_hf_name[hf_name] = t

  def get(hf_name):
    t = by_hf_name[hf_name]
    try:
      x = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise ValueError(
        f"unsupported GGUF quantisation {t.tensor_type.name} for tensor {t.name}"
      ) from None
    # GGUF lists dims innermost first; numpy wants them outermost first.
    x = np.asarray(x, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
    if hf_name.endswith("q_proj.weight"):
      x = _unpermute_qk(x, cfg.num_heads)
    elif hf_name.endswith("k_proj.weight"):
      x = _unpermute_qk(x, cfg.num_kv_heads)
    return x

  return get


# Our dense weights by GGUF tensor: (the layer's parameter path, the GGUF name's suffix).
_GGUF_DENSE = {
  ("attn", "q"): "attn_q",
  ("attn", "k"): "attn_k",
  ("attn", "v"): "attn_v",
  ("attn", "o"): "attn_output",
  ("mlp", "gate"): "ffn_gate",
  ("mlp", "up"): "ffn_up",
  ("mlp", "down"): "ffn_down",
}


def gguf_block_panels(reader, cfg: LlamaConfig, params: dict) -> dict:
  """`params` (per-layer, dense weights in panels) with every dense weight that the GGUF file
  stores in a block type the CPU kernel reads (`panels.BLOCK_BYTES`) as block-quantised panels
  of the file's own blocks: the same weights in a fifth of the bytes. A tied head
  stored as its own copy (`head_from_embedding`) takes the embedding's blocks."""
  tensors = {t.name: t for t in reader.tensors}

  def blocks(name, heads=None):
    t = tensors.get(name)
    if t is None or t.tensor_type.name not in panels.BLOCK_BYTES:
      return None
    k, n = (int(s) for s in t.shape)
    raw = np.asarray(t.data).reshape(n, -1)  # row j: output j's blocks along K
    if heads is not None:  # as `gguf_tensors` does to the dequantised rows
      raw = _unpermute_qk(raw, heads)
    return jnp.asarray(panels.pack_blocks(raw, t.tensor_type.name, k, n))

  params = dict(params)
  heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
  for i in range(cfg.num_layers):
    layer = dict(params[f"layers_{i}"])
    for (group, name), suffix in _GGUF_DENSE.items():
      w = blocks(f"blk.{i}.{suffix}.weight", heads.get(suffix))
      if w is not None:
        layer[group] = {**layer[group], name: w}
    params[f"layers_{i}"] = layer
  if "lm_head" in params:
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    w = blocks(head)
    if w is not None:
      params["lm_head"] = w
  return params


def head_from_embedding(get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
  """A tied model's tensors read as an untied one's: its LM head is the embedding."""
  return lambda name: get("model.embed_tokens.weight" if name == "lm_head.weight" else name)
