"""Checkpoint loading: the embedded GGUF against transformers' own GGUF loading; bad inputs."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pspec_jax import checkpoints, decode, testing, weights
from pspec_jax import prompts as prompts_lib

PROMPTS = [
  "What is the capital of France?",
  "Write a haiku about the sea.",
  "Explain recursion to a child in two sentences.",
  "List three prime numbers.",
  "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def hf_smollm2():
  source = checkpoints.resolve_target("smollm2-135m-instruct")
  directory, filename = os.path.split(source.path)
  return transformers.AutoModelForCausalLM.from_pretrained(
    directory, gguf_file=filename, dtype=torch.float32
  ).eval()


def test_gguf_logits_match_transformers_gguf_loading(smollm2, hf_smollm2):
  target, tokenizer = smollm2
  assert target.cfg.num_layers == 30 and target.cfg.hidden_size == 576
  assert target.cfg.num_kv_heads == 3 and target.cfg.tie_embeddings
  for prompt in PROMPTS[:3]:
    ids = prompts_lib.encode_prompt(tokenizer, prompt, chat=True)
    with torch.no_grad():
      ref = hf_smollm2(torch.tensor([ids])).logits.numpy()[0]
    features, _ = target(jnp.asarray([ids]), jnp.arange(len(ids))[None])
    ours = np.asarray(target.logits(features))[0]
    # Same dequantised weights; float32 summation order differs (measured max 1.4e-4 at
    # logit magnitudes ~30).
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_gguf_greedy_generations_match_transformers(smollm2, hf_smollm2):
  target, tokenizer = smollm2
  encoded = [prompts_lib.encode_prompt(tokenizer, p, chat=True) for p in PROMPTS]
  tokens, lengths = prompts_lib.pad_batch(encoded)
  cfg = decode.DecodeConfig(max_new_tokens=24, eos_ids=(tokenizer.eos_token_id,))
  out = decode.generate(target, tokens, lengths, jax.random.key(0), cfg)
  for row, ids in enumerate(encoded):
    with torch.no_grad():
      ref = hf_smollm2.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
      )[0, len(ids) :].tolist()
    assert out.tokens[row, : out.lengths[row]].tolist() == ref, PROMPTS[row]


def test_qk_unpermute_inverts_llama_cpp_permute():
  def llama_cpp_permute(w, n_head):  # as in llama.cpp's convert_hf_to_gguf.py
    return (
      w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )

  w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
  for heads in (1, 2, 3):
    np.testing.assert_array_equal(weights._unpermute_qk(llama_cpp_permute(w, heads), heads), w)


def test_embedded_default_resolves_without_importing_its_package():
  source = checkpoints.resolve_target("smollm2-135m-instruct")
  assert source.kind == "gguf" and source.path.endswith(".gguf") and os.path.isfile(source.path)


@pytest.fixture
def hf_dir(tmp_path):
  testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS["gqa_untied"])
  return tmp_path


def _edit_config(directory, **changes):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def test_bad_targets_raise_one_clear_error(tmp_path, hf_dir):
  cases = {
    "unknown target 'not-a-model'": "not-a-model",
    "target not found": str(tmp_path / "missing" / "dir"),
    "GGUF file not found": str(tmp_path / "missing.gguf"),
  }
  empty = tmp_path / "empty"
  empty.mkdir()
  cases["has no config.json"] = str(empty)
  for message, spec in cases.items():
    with pytest.raises(ValueError, match=message):
      checkpoints.load_target(spec)

  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="corrupt GGUF file"):
    checkpoints.load_target(str(garbage))


def test_corrupt_safetensors(hf_dir):
  weights = hf_dir / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:-1000])
  with pytest.raises(ValueError, match="corrupt safetensors file"):
    checkpoints.load_target(str(hf_dir))


def test_missing_weights(hf_dir):
  (hf_dir / "model.safetensors").unlink()
  with pytest.raises(ValueError, match="no model.safetensors"):
    checkpoints.load_target(str(hf_dir))


def test_unsupported_architecture(hf_dir):
  _edit_config(hf_dir, model_type="gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(ValueError, match="unsupported architecture"):
    checkpoints.load_target(str(hf_dir))


@pytest.mark.parametrize(
  "key,value,message",
  [
    ("hidden_size", None, "has no 'hidden_size': a Llama config.json needs it"),
    (
      "num_hidden_layers",
      "4",
      "has num_hidden_layers='4' (str), where a Llama config.json has an int",
    ),
    ("rms_norm_eps", [1e-6], "has rms_norm_eps=[1e-06] (list)"),
    ("tie_word_embeddings", "yes", "has tie_word_embeddings='yes' (str)"),
  ],
)
def test_a_config_json_with_a_missing_or_wrong_typed_key_names_it(hf_dir, key, value, message):
  """Before: KeyError / TypeError tracebacks from deep inside."""
  config = json.loads((hf_dir / "config.json").read_text())
  config[key] = value
  if value is None:
    del config[key]
  (hf_dir / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=re.escape(f"{hf_dir / 'config.json'}: {message}")):
    checkpoints.load_target(str(hf_dir))
  (hf_dir / "config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="must hold a JSON object"):
    checkpoints.load_target_config(str(hf_dir))


def test_a_hf_directory_without_tokenizer_files_says_so(hf_dir):
  """Before: "... You need to have sentencepiece or tiktoken installed"."""
  with pytest.raises(ValueError, match=rf"{hf_dir} has no tokenizer files \(one of tokenizer.json"):
    checkpoints.load_tokenizer(str(hf_dir))


def test_config_that_does_not_match_the_tensors(hf_dir):
  _edit_config(hf_dir, intermediate_size=80)
  with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \(64, 32\)"):
    checkpoints.load_target(str(hf_dir))
  _edit_config(hf_dir, intermediate_size=64, num_hidden_layers=4)
  with pytest.raises(ValueError, match="no tensor model.layers.3"):
    checkpoints.load_target(str(hf_dir))


def test_bfloat16_params(hf_dir):
  target = checkpoints.load_target(str(hf_dir), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(target.params))
  features, _ = target(jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None])
  assert features.dtype == jnp.bfloat16 and target.logits(features).dtype == jnp.float32


def test_a_gguf_tokenizer_is_built_once_then_read_back(tmp_path, monkeypatch, smollm2):
  monkeypatch.setenv("PSPEC_JAX_CACHE", str(tmp_path))
  cache = tmp_path / "tokenizers"
  built = checkpoints.load_tokenizer("smollm2-135m-instruct")
  (saved,) = os.listdir(cache)  # one complete copy, no partial one left
  read = checkpoints.load_tokenizer("smollm2-135m-instruct")
  assert read.name_or_path == str(cache / saved) and os.listdir(cache) == [saved]
  chat = [{"role": "user", "content": "Name three rivers. ünïcödé 日本語 🙂\n\tdef f(x): pass"}]
  expected = smollm2[1].apply_chat_template(chat, add_generation_prompt=True)
  for tokenizer in (built, read):
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == expected
    assert tokenizer.decode(expected, skip_special_tokens=True) == smollm2[1].decode(
      expected, skip_special_tokens=True
    )
    assert tokenizer.eos_token_id == 2 and len(tokenizer) == 49152
  # Reading it back does not import torch (over a second of every program start).
  program = "import sys; from pspec_jax import checkpoints as c; "
  program += "c.load_tokenizer('smollm2-135m-instruct'); print('torch' in sys.modules)"
  env = dict(os.environ, PSPEC_JAX_CACHE=str(tmp_path))
  run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
  assert run.stdout.split() == ["False"], run.stderr[-2000:]
  # An unwritable cache costs time, not the tokenizer.
  monkeypatch.setenv("PSPEC_JAX_CACHE", "/proc/no-such-dir")
  assert len(checkpoints.load_tokenizer("smollm2-135m-instruct")) == 49152


def test_one_gguf_file_is_parsed_once_until_it_changes(tmp_path):
  copy = tmp_path / "model.gguf"
  shutil.copyfile(checkpoints.resolve_target("smollm2-135m-instruct").path, copy)
  first = weights.gguf_reader(str(copy))
  assert weights.gguf_reader(str(copy)) is first  # config, weights and EOS ids share it
  os.utime(copy, ns=(0, 0))
  assert weights.gguf_reader(str(copy)) is not first


def test_gguf_header_reads_as_the_gguf_packages_reader(tmp_path):
  import gguf

  from pspec_jax import gguf_file

  path = checkpoints.resolve_target("smollm2-135m-instruct").path
  ours, reference = gguf_file.GGUFFile(path), gguf.GGUFReader(path)
  fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
  assert _typed(ours.fields) == _typed(fields)  # tokenizer arrays, strings, ints, bools, floats
  assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
  for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
    assert mine.shape == tuple(int(n) for n in theirs.shape)
    assert mine.tensor_type == theirs.tensor_type and mine.data.dtype == theirs.data.dtype
    np.testing.assert_array_equal(mine.data, theirs.data)
  # A file cut short anywhere is one error, whether in its header or its tensors.
  with open(path, "rb") as fh:
    head = fh.read(4 << 20)
  for size in (3, 100, 10_000, 4 << 20):
    cut = tmp_path / f"cut{size}.gguf"
    cut.write_bytes(head[:size])
    with pytest.raises(ValueError, match="corrupt GGUF file"):
      checkpoints.load_target_config(str(cut))


def _typed(fields):
  """Values with their types (True == 1 == 1.0 in Python)."""

  def typed(v):
    return [typed(x) for x in v] if isinstance(v, list) else (type(v), v)

  return {k: typed(v) for k, v in fields.items()}


def test_gguf_header_reads_every_value_and_tensor_type(tmp_path):
  import gguf
  import ml_dtypes

  from pspec_jax import gguf_file

  path = tmp_path / "all.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_custom_alignment(64)
  writer.add_bool("t.flag", True)
  writer.add_int64("t.big", -(2**40))
  writer.add_float64("t.pi", 3.25)
  writer.add_uint8("t.byte", 200)
  writer.add_array("t.floats", [0.5, -1.5])
  writer.add_array("t.bools", [True, False])
  writer.add_array("t.nested", [[1, 2], [3]])
  rng = np.random.default_rng(0)
  tensors = {
    "f16": rng.standard_normal((3, 5)).astype(np.float16),
    "i32": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
    "f32": rng.standard_normal(7).astype(np.float32),
  }
  for name, x in tensors.items():
    writer.add_tensor(name, x)
  bf16 = rng.standard_normal((2, 6)).astype(ml_dtypes.bfloat16)
  writer.add_tensor("bf16", bf16.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()

  ours = gguf_file.GGUFFile(str(path))
  assert _typed({k: v for k, v in ours.fields.items() if k.startswith("t.")}) == _typed(
    {
      "t.flag": True,
      "t.big": -(2**40),
      "t.pi": 3.25,
      "t.byte": 200,
      "t.floats": [0.5, -1.5],
      "t.bools": [True, False],
      "t.nested": [[1, 2], [3]],
    }
  )
  assert ours.fields["general.alignment"] == 64
  reference = gguf.GGUFReader(str(path))
  assert [t.name for t in ours.tensors] == ["f16", "i32", "f32", "bf16"]
  for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
    assert mine.shape == tuple(int(n) for n in theirs.shape)
    assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
    np.testing.assert_array_equal(mine.data, theirs.data)
  by_name = {t.name: t.data for t in ours.tensors}
  for name, x in tensors.items():
    np.testing.assert_array_equal(by_name[name], x)
  np.testing.assert_array_equal(by_name["bf16"].view(ml_dtypes.bfloat16), bf16)


def _header(*fields, tensors=()):
  """A GGUF v3 header: (key, type, payload bytes) fields, then (name, dims, type) tensor infos."""
  import struct

  out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields))
  for key, kind, payload in fields:
    out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload
  for name, dims, kind in tensors:
    out += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
    out += struct.pack(f"<{len(dims)}QIQ", *dims, kind, 0)
  return out


@pytest.mark.parametrize(
  "body,message",
  [
    (_header(("a", 4, b"\1\0\0\0"), ("a", 4, b"\2\0\0\0")), "'a' appears twice"),
    (
      _header(("n", 9, b"".join(b"\x09\0\0\0\1\0\0\0\0\0\0\0" for _ in range(20)))),
      "nested deeper",
    ),
    (_header(("general.alignment", 7, b"\1")), "bad general.alignment True"),
    (_header(("x", 13, b"")), "unknown GGUF metadata type 13"),
    (_header(tensors=[("w", (), 2)]), "tensor w has 0 dimensions"),
    (_header(tensors=[("w", (4,), 99)]), "tensor w has unknown type 99"),
    (_header(tensors=[("w", (4,), 0), ("w", (4,), 0)]), "a tensor name appears twice"),
    (_header(tensors=[("w", (4,), 0)]), "tensor w runs past the end"),
    (b"GGUF\0\0\0\3" + bytes(16), "big-endian"),
    (b"GGUF\1\0\0\0" + bytes(16), "unsupported GGUF version 1"),
  ],
)
def test_a_malformed_gguf_header_is_one_clear_error(tmp_path, body, message):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(body)
  with pytest.raises(ValueError, match=f"corrupt GGUF file .*{message}"):
    checkpoints.load_target_config(str(bad))
