"""The curated public surface: `import pspec_jax as pj` names what a user needs, each name
resolves to the library's own object, and importing the package alone stays light."""

import subprocess
import sys

import pspec_jax as pj
from pspec_jax import checkpoints, decode, decode_plan, drafter_files, prompts, sampling, sharding

SURFACE = {
  "generate": decode.generate,
  "stream": decode.stream,
  "shard": decode.shard,
  "DecodeConfig": decode_plan.DecodeConfig,
  "SamplingConfig": sampling.SamplingConfig,
  "load_target": checkpoints.load_target,
  "load_tokenizer": checkpoints.load_tokenizer,
  "eos_token_ids": checkpoints.eos_token_ids,
  "encode_prompt": prompts.encode_prompt,
  "pad_batch": prompts.pad_batch,
  "load_drafter": drafter_files.load_drafter,
  "resolve_drafter": drafter_files.resolve_drafter,
  "make_mesh": sharding.make_mesh,
}


def test_the_package_names_the_public_surface():
  assert sorted(pj.__all__) == sorted([*SURFACE, "cache_dir"])
  assert [n for n in dir(pj) if not n.startswith("__")] == sorted(pj.__all__)
  for name, obj in SURFACE.items():
    assert getattr(pj, name) is obj, name


def test_an_unknown_name_is_an_attribute_error():
  try:
    pj.no_such_name  # noqa: B018
  except AttributeError as e:
    assert "no_such_name" in str(e)
  else:
    raise AssertionError("pj.no_such_name resolved")


def test_importing_the_package_imports_no_jax():
  """Configs and `--help` import the package for `cache_dir`: jax loads on first use only."""
  code = "import sys, pspec_jax; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


def test_the_round_functions_take_the_plan_first():
  import inspect

  from pspec_jax import rounds

  for fn in (rounds.init, rounds.verify, rounds.draft, rounds.round_step):
    assert list(inspect.signature(fn).parameters)[:3] == ["plan", "target", "drafter"], fn
  for fn in (rounds.accept_path, rounds.commit):
    assert list(inspect.signature(fn).parameters)[:2] == ["plan", "state"], fn
