"""Drafter files: a directory with `drafter.json` (config) and `drafter.safetensors` (params).

The JSON records the drafter's kind, K, tree preset, layer widths and the identity of the
target it was built for (name, vocab size, feature width); loading it against another target
is one clear error. Parameters are stored flat (`block/attn/q`, ...) in float32.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from pspec_jax.checkpoints import read_safetensors
from pspec_jax.drafter import KINDS, Drafter, DrafterConfig, init_params, random_drafter
from pspec_jax.llama import RopeScaling, Target

FORMAT_VERSION = 1
CONFIG_FILE = "drafter.json"
PARAMS_FILE = "drafter.safetensors"
_LAYER_FIELDS = (
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "intermediate_size",
  "rope_theta",
  "rms_norm_eps",
)


def save_drafter(directory: str, drafter: Drafter, extra: dict | None = None) -> None:
  """Writes the drafter's config and parameters (plus `extra` notes in the JSON)."""
  from safetensors.numpy import save_file

  cfg = drafter.cfg
  config = dict(
    format_version=FORMAT_VERSION,
    kind=cfg.kind,
    num_draft=cfg.num_draft,
    tree=cfg.tree,
    target=dict(name=cfg.target_name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size),
    layer={f: getattr(cfg, f) for f in _LAYER_FIELDS}
    | dict(rope_scaling=None if cfg.rope_scaling is None else vars(cfg.rope_scaling)),
    max_ngram=cfg.max_ngram,
  ) | (extra or {})
  os.makedirs(directory, exist_ok=True)
  flat = traverse_util.flatten_dict(jax.device_get(drafter.params), sep="/")
  save_file(
    {k: np.ascontiguousarray(v, np.float32) for k, v in flat.items()},
    os.path.join(directory, PARAMS_FILE),
  )
  with open(os.path.join(directory, CONFIG_FILE), "w") as fh:
    json.dump(config, fh, indent=2)


def load_drafter(directory: str, target: Target) -> Drafter:
  """Reads a drafter saved by `save_drafter` for `target`. One ValueError for any bad input."""
  config_path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise ValueError(f"drafter not found: {config_path} does not exist")
  try:
    with open(config_path) as fh:
      config = json.load(fh)
    kind, identity, layer = config["kind"], config["target"], dict(config.get("layer", {}))
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"corrupt drafter config {config_path}: {e}") from None
  t = target.cfg
  if (identity.get("name"), identity.get("vocab_size"), identity.get("hidden_size")) != (
    t.name,
    t.vocab_size,
    t.hidden_size,
  ):
    raise ValueError(
      f"the drafter in {directory} was built for target {identity.get('name')!r} (vocab "
      f"{identity.get('vocab_size')}, width {identity.get('hidden_size')}), not for {t.name!r} "
      f"(vocab {t.vocab_size}, width {t.hidden_size})"
    )
  if kind not in KINDS:
    raise ValueError(f"drafter in {directory} has unknown kind {kind!r}")
  scaling = layer.pop("rope_scaling", None)
  cfg = DrafterConfig.for_target(
    kind,
    t,
    num_draft=int(config.get("num_draft", 1)),
    tree=config.get("tree", "chain"),
    max_ngram=int(config.get("max_ngram", 3)),
    rope_scaling=None if scaling is None else RopeScaling(**scaling),
    **{f: layer[f] for f in _LAYER_FIELDS if f in layer},
  )
  expected = traverse_util.flatten_dict(
    jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), sep="/"
  )
  stored = read_safetensors(os.path.join(directory, PARAMS_FILE)) if expected else {}
  params = {}
  for name, spec in expected.items():
    if name not in stored or tuple(stored[name].shape) != spec.shape:
      got = stored[name].shape if name in stored else "nothing"
      raise ValueError(f"drafter {directory}: tensor {name} should be {spec.shape}, found {got}")
    params[name] = jnp.asarray(np.asarray(stored[name]), cfg.param_dtype)
  return Drafter(cfg=cfg, params=traverse_util.unflatten_dict(params, sep="/"))


def resolve_drafter(
  method: str, spec: str | None, target: Target, *, seed: int = 0, num_draft: int = 4
) -> Drafter | None:
  """The drafter a command line asks for.

  Args:
    method: `none` (no drafter) or a drafter kind.
    spec: a drafter directory, or `random` for an untrained drafter (seeded); pld needs none.
    target: the target it drafts for.
    seed: seeds a random drafter.
    num_draft: K of a random or pld drafter (a saved drafter keeps its own).
  """
  if method == "none":
    return None
  if method not in KINDS:
    raise ValueError(f"unknown method {method!r}: use none or one of {', '.join(KINDS)}")
  if method == "pld":
    cfg = DrafterConfig.for_target("pld", target.cfg, num_draft=num_draft)
    return Drafter(cfg=cfg, params={})
  if not spec:
    raise ValueError(f"--method={method} needs --drafter (a drafter directory, or random)")
  if spec == "random":
    return random_drafter(method, target, jax.random.key(seed), num_draft=num_draft)
  drafter = load_drafter(spec, target)
  if drafter.cfg.kind != method:
    raise ValueError(f"the drafter in {spec} is a {drafter.cfg.kind} drafter, not {method}")
  return drafter
