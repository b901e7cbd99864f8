"""Memory planning for decoding: per-device bytes on a mesh, from shapes alone.

Parameters and caches are sized exactly from `jax.eval_shape` and the shardings the rules give
on the mesh (an `AbstractMesh`: no device is needed, nothing is allocated); activations are an
estimate (the largest of the prefill's one-layer working set and the verification logits).
Where this host has the hardware's devices, `decode.generate`'s program is also compiled for
the mesh on abstract arguments, and XLA's memory analysis of it is printed per method.
"""

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from pspec_jax import decode, llama, sharding, tree_specs
from pspec_jax import drafter as drafter_lib
from pspec_jax.presets import HARDWARE, not_this_host, platform

GIB = 1024**3


def decode_memory_table(
  target: llama.LlamaConfig,
  drafters: list[drafter_lib.DrafterConfig],
  *,
  batch: int,
  prompt_width: int,
  max_new_tokens: int,
  tree_nodes: int,
  tree_depth: int,
  hardware: str,
  mesh: dict[str, int],
) -> str:
  """A text table of per-device bytes for decoding, and whether it fits `hardware`."""
  if hardware not in HARDWARE:
    raise ValueError(f"unknown hardware {hardware!r}: use one of {', '.join(HARDWARE)}")
  devices, memory_gib = HARDWARE[hardware]
  shape = sharding.mesh_shape(devices, **mesh)
  abstract = AbstractMesh(shape, sharding.AXES, axis_types=(AxisType.Auto,) * 3)
  key = jax.random.key(0)
  width = np.dtype(target.dtype).itemsize

  def params_bytes(init_params, init_boxed, cfg):
    shapes = jax.eval_shape(lambda: init_params(cfg, key))
    placed = sharding.param_shardings(init_boxed, cfg, abstract)
    return sharding.bytes_per_device(shapes, placed), sum(
      int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)
    )

  def cache_bytes(layers, kv_heads, head_dim, max_len):
    x = jax.ShapeDtypeStruct((layers, batch, max_len, kv_heads, head_dim), target.dtype)
    spec = sharding.spec_for(PartitionSpec(*decode.CACHE_AXES), x.shape, abstract)
    return 2 * sharding.bytes_per_device([x], [NamedSharding(abstract, spec)])

  max_len = prompt_width + max_new_tokens + tree_depth
  target_bytes, target_count = params_bytes(llama.init_params, llama.init_boxed, target)
  rows = {"target params": target_bytes}
  for d in drafters:
    rows[f"drafter params ({d.kind})"] = params_bytes(
      drafter_lib.init_params, drafter_lib.init_boxed, d
    )[0]
  rows["target KV cache"] = cache_bytes(
    target.num_layers, target.num_kv_heads, target.head_dim, max_len
  )
  for d in drafters:
    if d.kind in ("pspec", "eagle"):
      layer = d.layer
      rows[f"drafter KV cache ({d.kind})"] = cache_bytes(
        d.num_layers, layer.num_kv_heads, layer.head_dim, max_len
      )
  seqs = max(batch // (shape[0] * shape[1]), 1)
  tensor = shape[2]
  tokens = seqs * prompt_width
  heads = max(target.num_heads // tensor, 1)
  prefill = tokens * (6 * target.hidden_size + 3 * target.intermediate_size // tensor) * width
  prefill += seqs * heads * prompt_width * (prompt_width + max_len) * 4
  verify = 3 * seqs * tree_nodes * target.vocab_size // tensor * 4
  rows["activations (est.)"] = max(prefill, verify)
  total = sum(rows.values())
  lines = [
    f"target {target.name}: {target_count / 1e9:.3f}B parameters in {np.dtype(target.dtype)}",
    f"hardware {hardware}: {devices} devices, {memory_gib:g} GiB each; mesh "
    + ", ".join(f"{a}={n}" for a, n in zip(sharding.AXES, shape, strict=True))
    + f"; batch {batch}, prompt width {prompt_width}, {max_new_tokens} new tokens, "
    + f"trees of {tree_nodes} nodes (depth {tree_depth})",
    f"{'per device':34s} {'GiB':>9s}",
  ]
  lines += [f"{name:34s} {b / GIB:9.3f}" for name, b in rows.items()]
  verdict = "fits" if total <= memory_gib * GIB else "does NOT fit"
  lines.append(f"{'total':34s} {total / GIB:9.3f}  {verdict} in {memory_gib:g} GiB")
  return "\n".join(lines)


def _abstract_params(init_params, init_boxed, cfg, mesh):
  """Parameter shapes with their shardings on `mesh`: arguments to lower a program with."""
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  return sharding.abstract(shapes, sharding.param_shardings(init_boxed, cfg, mesh))


def compiled_decode_bytes(
  target: llama.LlamaConfig,
  drafter: drafter_lib.DrafterConfig | None,
  *,
  batch: int,
  prompt_width: int,
  max_new_tokens: int,
  tree: str,
  mesh,
) -> dict[str, int]:
  """Per-device bytes of `decode.generate` compiled for `mesh` (a concrete one), from XLA's
  memory analysis; the KV caches live inside the program, so they count as temporaries."""
  params = _abstract_params(llama.init_params, llama.init_boxed, target, mesh)
  model = llama.Target(cfg=target, params=params)
  draft = None
  if drafter is not None:
    draft_params = _abstract_params(drafter_lib.init_params, drafter_lib.init_boxed, drafter, mesh)
    draft = drafter_lib.Drafter(cfg=drafter, params=draft_params)
    params = (params, draft_params)
  cfg = decode.DecodeConfig(max_new_tokens=max_new_tokens, tree=tree, mesh=mesh)
  tokens = jax.ShapeDtypeStruct((batch, prompt_width), np.int32)
  lengths = jax.ShapeDtypeStruct((batch,), np.int32)
  compiled = decode.compile_generate(model, tokens, lengths, jax.random.key(0), cfg, draft)
  stats = compiled.memory_analysis()
  shardings = jax.tree.map(lambda x: x.sharding, params)
  return {
    "parameters held": sharding.bytes_per_device(params, shardings),
    "outputs": stats.output_size_in_bytes - stats.alias_size_in_bytes,
    "temporaries (caches included)": stats.temp_size_in_bytes,
  }


def compiled_decode_table(
  target, drafters, *, hardware: str, mesh: dict, tree: str, **shape
) -> str:
  """`compiled_decode_bytes` of plain decoding and of each drafter (on `tree`), one line each,
  where this host has `hardware`'s devices; else one line says why not."""
  devices, memory_gib = HARDWARE[hardware]
  if reason := not_this_host(devices, platform(hardware)):
    return reason
  concrete = sharding.make_mesh(**mesh)
  lines = [f"compiled decoding on {devices} {platform(hardware)} device(s), per device, GiB"]
  for d in [None, *drafters]:
    rows = compiled_decode_bytes(target, d, tree=tree if d else "", mesh=concrete, **shape)
    total = sum(rows.values())
    verdict = "fits" if total <= memory_gib * GIB else "does NOT fit"
    lines.append(
      f"{d.kind if d else 'none':8s} "
      + ", ".join(f"{name} {b / GIB:.3f}" for name, b in rows.items())
      + f"; total {total / GIB:.3f} {verdict} in {memory_gib:g} GiB"
    )
  return "\n".join(lines)


def decode_plan(
  target: llama.LlamaConfig,
  kinds: list[str],
  *,
  num_draft: int,
  trees: list[str],
  batch: int,
  prompt_width: int,
  max_new_tokens: int,
  hardware: str,
  mesh: dict[str, int],
) -> str:
  """The memory plan of decoding on `hardware`'s `mesh`: `decode_memory_table` for drafters of
  `kinds` at K = `num_draft` and the largest of `trees` ("" is a chain), then
  `compiled_decode_table` where this host has the hardware's devices."""
  drafters = [drafter_lib.DrafterConfig.for_target(k, target, num_draft=num_draft) for k in kinds]
  specs = [t or "chain" for t in trees]
  parsed = [tree_specs.parse(t, num_draft) for t in specs]
  largest = max(zip(specs, parsed, strict=True), key=lambda st: st[1].num_verified)[0]
  shape = dict(batch=batch, prompt_width=prompt_width, max_new_tokens=max_new_tokens)
  table = decode_memory_table(
    target,
    drafters,
    **shape,
    tree_nodes=max(t.num_verified for t in parsed),
    tree_depth=max(t.max_depth for t in parsed),
    hardware=hardware,
    mesh=mesh,
  )
  compiled = compiled_decode_table(
    target, drafters, hardware=hardware, mesh=mesh, tree=largest, **shape
  )
  return f"{table}\n{compiled}"
