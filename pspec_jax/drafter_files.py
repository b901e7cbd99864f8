"""Drafter files: a directory with `drafter.json` (config) and `drafter.safetensors` (params).

The JSON records the drafter's kind, K, tree presets (its fixed tree, greedy and optionally
sampling, the candidate sets of its `adaptive` tree, greedy and optionally sampling, and which
of the two it decodes with by default, plus per-device ones, `device_trees`, which may also cut
the draft vocabulary decoding uses there), layer widths, its
architecture options (`num_layers`, `feature_layers`, `mask_input`; absent in older files, which
are the defaults) and the identity of the target it was built for (name, vocab size, feature
width); loading it against another target is one clear error. A file that uses an architecture
option has format version 2, which older readers refuse instead of misreading it. Parameters
are stored flat (`block/attn/q`, ...; medusa's K heads as one [D, K, D] tensor `heads`, which
older files hold as `w` [K, D, D], read either way), in float32 or bfloat16, next to the token
ids of a restricted draft vocabulary (`draft_vocab`), if the drafter has one. A drafter
directory may be local or a URL such as gs://bucket/export: both are written and read through
`etils.epath`.
"""

import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util

from pspec_jax import tree_specs
from pspec_jax.drafter import KINDS, Drafter, DrafterConfig, init_params, random_drafter
from pspec_jax.drafter_config import DEFAULT_TREES
from pspec_jax.llama import LlamaConfig, RopeScaling, Target
from pspec_jax.weights import read_safetensors

__all__ = [
  "CONFIG_FILE",
  "DEVICE_TREES",
  "FORMAT_VERSION",
  "PARAMS_FILE",
  "SHIPPED_DIR",
  "VOCAB_TENSOR",
  "drafter_source",
  "load_drafter",
  "read_drafter_config",
  "resolve_drafter",
  "save_drafter",
  "shipped_drafter",
]

FORMAT_VERSION = 2
# Architecture options (DrafterConfig fields) and their defaults, which version-1 files have.
_ARCH_DEFAULTS = dict(num_layers=1, feature_layers=(), mask_input="per_depth")
CONFIG_FILE = "drafter.json"
PARAMS_FILE = "drafter.safetensors"
VOCAB_TENSOR = "draft_vocab"  # int32 token ids of a restricted draft vocabulary
# {platform: {"tree": ..., "sampling_tree": ..., "default_tree": ..., "adaptive": ...,
# "sampling_adaptive": ..., "draft_vocab_size": ...}}:
# decoding tuned on one kind of device. `draft_vocab_size` there decodes from the first tokens
# of the stored draft vocabulary (the most frequent first): where a drafter pass is bound by
# reading its LM head, as on a CPU, a smaller head is worth more than the rare tokens it leaves
# out.
DEVICE_TREES = "device_trees"
_DEVICE_FIELDS = {
  "tree",
  "sampling_tree",
  "default_tree",
  "adaptive",
  "sampling_adaptive",
  "draft_vocab_size",
}
# Drafters trained by the project, by target name and kind: drafters/<target>/<kind>/.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters")
_LAYER_FIELDS = {  # name -> type
  "num_heads": int,
  "num_kv_heads": int,
  "head_dim": int,
  "intermediate_size": int,
  "rope_theta": float,
  "rms_norm_eps": float,
}


def save_drafter(
  directory: str | os.PathLike, drafter: Drafter, extra: dict | None = None, dtype=np.float32
) -> None:
  """Writes the drafter's config and parameters (plus `extra` notes in the JSON).

  `directory` may be local or a URL such as gs://bucket/run/export (written through
  `etils.epath`). `dtype` is the storage type of the parameters (e.g. `ml_dtypes.bfloat16` to
  halve the file); they are loaded back in the drafter's own `param_dtype`.
  """
  from safetensors.numpy import save

  drafter = drafter.with_weight_layout("plain")  # files hold the plain layout
  cfg = drafter.cfg
  arch = {f: getattr(cfg, f) for f in _ARCH_DEFAULTS}
  config = dict(
    format_version=1 if arch == _ARCH_DEFAULTS else FORMAT_VERSION,
    kind=cfg.kind,
    num_draft=cfg.num_draft,
    tree=cfg.tree,
    sampling_tree=cfg.sampling_tree,
    default_tree=cfg.default_tree,
    adaptive=cfg.adaptive,
    sampling_adaptive=cfg.sampling_adaptive,
    target=dict(name=cfg.target_name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size),
    layer={f: getattr(cfg, f) for f in _LAYER_FIELDS}
    | dict(rope_scaling=None if cfg.rope_scaling is None else vars(cfg.rope_scaling)),
    max_ngram=cfg.max_ngram,
    draft_vocab_size=cfg.draft_vocab_size,
  ) | ({} if arch == _ARCH_DEFAULTS else arch | dict(feature_layers=list(cfg.feature_layers)))
  config |= extra or {}
  out = epath.Path(directory)
  out.mkdir(parents=True, exist_ok=True)
  flat = traverse_util.flatten_dict(jax.device_get(drafter.params), sep="/")
  tensors = {
    k: np.ascontiguousarray(np.asarray(v, np.float32).astype(dtype)) for k, v in flat.items()
  }
  if drafter.vocab is not None:
    tensors[VOCAB_TENSOR] = np.asarray(drafter.vocab, np.int32)
  (out / PARAMS_FILE).write_bytes(save(tensors))
  (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def read_drafter_config(
  directory: str | os.PathLike,
  target: LlamaConfig,
  platform: str | None = None,
  *,
  as_stored: bool = False,
) -> DrafterConfig:
  """The config of a drafter saved by `save_drafter`, checked against the target it is for;
  reads `drafter.json` only. One ValueError for any bad input.

  Its trees and draft vocabulary size are those of `device_trees[platform]` where the file has
  an entry for `platform` (default: JAX's backend, `cpu`, `gpu` or `tpu`), else the file's own:
  the tree that decodes fastest depends on what a verified node costs on the device, and the
  draft vocabulary worth reading on what reading its head costs. `as_stored`: the file's own
  (the drafter as trained, what training continues from), whatever the device.
  """
  return _read_config(directory, target, platform, as_stored)[0]


def _read_config(directory, target: LlamaConfig, platform: str | None, as_stored: bool):
  """(`read_drafter_config`'s config, the number of token ids stored in its draft vocabulary)."""
  config_path = epath.Path(directory) / CONFIG_FILE
  if not config_path.is_file():
    raise ValueError(f"drafter not found: {config_path} does not exist")
  try:
    config = json.loads(config_path.read_text())
    identity = config["target"]
    identity = (identity["name"], identity["vocab_size"], identity["hidden_size"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"corrupt drafter config {config_path}: {e!r}") from None
  if config.get("format_version", 1) > FORMAT_VERSION:
    raise ValueError(
      f"drafter {directory} has format version {config['format_version']}; this pspec_jax "
      f"reads up to {FORMAT_VERSION}: upgrade pspec_jax"
    )
  if identity != (target.name, target.vocab_size, target.hidden_size):
    raise ValueError(
      f"the drafter in {directory} was built for target {identity[0]!r} (vocab {identity[1]}, "
      f"width {identity[2]}), not for {target.name!r} (vocab {target.vocab_size}, "
      f"width {target.hidden_size})"
    )
  try:
    layer = dict(config.get("layer", {}))
    scaling = layer.pop("rope_scaling", None)
    num_draft = int(config.get("num_draft", 1))
    device_trees = config.get(DEVICE_TREES, {})
    stored_vocab = int(config.get("draft_vocab_size", 0))
    if not isinstance(device_trees, dict) or not all(
      isinstance(e, dict) and set(e) <= _DEVICE_FIELDS for e in device_trees.values()
    ):
      raise ValueError(f"{DEVICE_TREES} must map a platform to some of {sorted(_DEVICE_FIELDS)}")
    for platform_name, entry in device_trees.items():
      for name, spec in entry.items():
        if name == "draft_vocab_size":
          if not stored_vocab:
            raise ValueError(
              f"{DEVICE_TREES}.{platform_name}.draft_vocab_size: the drafter drafts from the "
              "whole vocabulary, not a stored draft vocabulary to take the first tokens of"
            )
          if type(spec) is not int or not 0 < spec <= stored_vocab:
            raise ValueError(
              f"{DEVICE_TREES}.{platform_name}.draft_vocab_size must be an integer in "
              f"[1, {stored_vocab}] (the stored draft vocabulary), got {spec!r}"
            )
          continue
        if name == "default_tree":
          if spec not in DEFAULT_TREES:
            raise ValueError(
              f"{DEVICE_TREES}.{platform_name}.default_tree must be one of "
              f"{', '.join(DEFAULT_TREES)}, got {spec!r}"
            )
          continue
        if name in ("adaptive", "sampling_adaptive"):
          spec = f"adaptive:{spec}"
        try:
          tree_specs.parse(spec, num_draft)
        except ValueError as e:
          raise ValueError(f"{DEVICE_TREES}.{platform_name}.{name}: {e}") from None
    device = {} if as_stored else device_trees.get(platform or jax.default_backend(), {})
    cfg = DrafterConfig.for_target(
      config["kind"],
      target,
      num_draft=num_draft,
      tree=str(device.get("tree", config.get("tree", "chain"))),
      sampling_tree=str(device.get("sampling_tree", config.get("sampling_tree", ""))),
      default_tree=str(device.get("default_tree", config.get("default_tree", "fixed"))),
      adaptive=str(device.get("adaptive", config.get("adaptive", ""))),
      sampling_adaptive=str(device.get("sampling_adaptive", config.get("sampling_adaptive", ""))),
      max_ngram=int(config.get("max_ngram", 3)),
      draft_vocab_size=int(device.get("draft_vocab_size", stored_vocab)),
      num_layers=int(config.get("num_layers", 1)),
      feature_layers=tuple(int(i) for i in config.get("feature_layers", ())),
      mask_input=str(config.get("mask_input", "per_depth")),
      rope_scaling=None if scaling is None else RopeScaling(**scaling),
      **{f: kind(layer[f]) for f, kind in _LAYER_FIELDS.items() if f in layer},
    )
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"corrupt drafter config {config_path}: {e}") from None
  if any(i >= target.num_layers for i in cfg.feature_layers):
    raise ValueError(
      f"the drafter in {directory} reads target layers {cfg.feature_layers}, but "
      f"{target.name!r} has {target.num_layers}"
    )
  return cfg, stored_vocab


def load_drafter(
  directory: str | os.PathLike, target: Target, *, as_stored: bool = False
) -> Drafter:
  """Reads a drafter saved by `save_drafter` for `target` (a local directory or a URL such as
  gs://bucket/export, read through `etils.epath`), set for decoding on this device
  (`read_drafter_config`). One ValueError for any bad input.

  `as_stored`: the drafter as its file stores it, with the file's own trees and whole draft
  vocabulary, whatever the device: what training continues from.
  """
  cfg, stored_vocab = _read_config(directory, target.cfg, None, as_stored)
  # Files hold the plain layout; the drafter takes the target's once read.
  cfg = cfg.replace(weight_layout="plain")
  expected = traverse_util.flatten_dict(
    jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), sep="/"
  )
  if stored_vocab:
    expected[VOCAB_TENSOR] = jax.ShapeDtypeStruct((stored_vocab,), np.int32)
  stored = _read_tensors(epath.Path(directory) / PARAMS_FILE) if expected else {}
  if cfg.kind == "medusa" and "heads" not in stored and "w" in stored:
    stored["heads"] = np.swapaxes(stored.pop("w"), 0, 1)  # older files: K weights [K, D, D]
  params = {}
  for name, spec in expected.items():
    if name not in stored or tuple(stored[name].shape) != spec.shape:
      got = stored[name].shape if name in stored else "nothing"
      raise ValueError(f"drafter {directory}: tensor {name} should be {spec.shape}, found {got}")
    params[name] = stored[name]
  vocab = None
  if stored_vocab:
    vocab = np.asarray(params.pop(VOCAB_TENSOR))
    if vocab.min() < 0 or vocab.max() >= cfg.vocab_size or len(set(vocab.tolist())) < len(vocab):
      raise ValueError(f"drafter {directory}: corrupt draft vocabulary ({VOCAB_TENSOR})")
    vocab = jnp.asarray(vocab, jnp.int32)
  params = {k: jnp.asarray(np.asarray(v, np.float32), cfg.param_dtype) for k, v in params.items()}
  params = traverse_util.unflatten_dict(params, sep="/")
  drafter = Drafter(cfg=cfg.replace(draft_vocab_size=stored_vocab), params=params, vocab=vocab)
  if cfg.draft_vocab_size != stored_vocab:
    drafter = drafter.with_draft_vocab(cfg.draft_vocab_size)
  drafter = drafter.with_weight_layout(target.cfg.weight_layout)
  # A target decoding from GGUF blocks: the drafter's dense weights in blocks too.
  drafter = drafter.with_blocks() if target.keeps_blocks else drafter
  return drafter.with_head(target)  # once here, not in every decode


def _read_tensors(path: epath.Path) -> dict[str, np.ndarray]:
  """The tensors of a parameters file: memory-mapped where the file is local; a remote one
  (gs://...) is copied to a temporary local file first."""
  if "://" not in os.fspath(path):
    return read_safetensors(os.fspath(path))
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ValueError(f"cannot read {path}: {e}") from None
  with tempfile.TemporaryDirectory() as tmp:
    local = os.path.join(tmp, PARAMS_FILE)
    with open(local, "wb") as fh:
      fh.write(data)
    return {name: np.array(x) for name, x in read_safetensors(local).items()}


def shipped_drafter(target_name: str, kind: str) -> str | None:
  """The directory of the drafter of `kind` shipped for a target, or None."""
  path = os.path.join(SHIPPED_DIR, target_name, kind)
  return path if os.path.isfile(os.path.join(path, CONFIG_FILE)) else None


def drafter_source(method: str, spec: str | None, target_name: str) -> str | None:
  """Where the drafter a command line asks for comes from, checked without loading anything:
  a drafter directory, `random`, or None (`none` and `pld` need no drafter file).

  Args:
    method: `none` (no drafter) or a drafter kind.
    spec: a drafter directory, or `random` for an untrained drafter; pld needs none.
      None or empty: the drafter of this kind shipped for the target, if there is one.
    target_name: the target's name, which picks its shipped drafter.
  """
  if method not in ("none", *KINDS):
    raise ValueError(f"unknown method {method!r}: use none or one of {', '.join(KINDS)}")
  if method in ("none", "pld") and spec:
    raise ValueError(f"--method={method} takes no --drafter")
  if method in ("none", "pld"):
    return None
  spec = spec or shipped_drafter(target_name, method)
  if not spec:
    raise ValueError(
      f"--method={method} needs --drafter (a drafter directory, or random): no {method} "
      f"drafter ships for target {target_name!r}"
    )
  config_path = epath.Path(spec) / CONFIG_FILE
  if spec != "random" and not config_path.is_file():
    raise ValueError(f"drafter not found: {config_path} does not exist")
  return spec


def resolve_drafter(
  method: str, spec: str | None, target: Target, *, seed: int = 0, num_draft: int = 4
) -> Drafter | None:
  """The drafter a command line asks for (see `drafter_source`) for `target`.

  `seed` seeds a random drafter; `num_draft` is the K of a random or pld drafter (a saved
  drafter keeps its own).
  """
  spec = drafter_source(method, spec, target.cfg.name)
  if method == "none":
    return None
  if method == "pld":
    # Prompt lookup verifies its K tokens only in rounds that found a match (`tree_specs.parse`);
    # adaptive, also K more, or none, by how often its chains were accepted.
    cfg = DrafterConfig.for_target(
      "pld",
      target.cfg,
      num_draft=num_draft,
      tree="lookup",
      adaptive=f"lookup:{num_draft}|lookup:{2 * num_draft}",
    )
    return Drafter(cfg=cfg, params={})
  if spec == "random":
    return random_drafter(method, target, jax.random.key(seed), num_draft=num_draft)
  drafter = load_drafter(spec, target)
  if drafter.cfg.kind != method:
    raise ValueError(f"the drafter in {spec} is a {drafter.cfg.kind} drafter, not {method}")
  return drafter
