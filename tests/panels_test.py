"""Panel-packed dense weights (`pspec_jax.panels`): the plain layout's products, row for row,
through the CPU panel kernel and through XLA's path alike."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import flatten_util

from pspec_jax import checkpoints, cpu_kernel, drafter_files, llama, panels, testing
from pspec_jax import drafter as drafter_lib

# M rows, K inputs, N outputs: N and K on and off multiples of the 64-column panel.
SHAPES = [(1, 100, 130), (2, 64, 64), (3, 70, 200), (4, 576, 192), (5, 128, 65), (8, 33, 300)]
SHAPES += [(11, 96, 129), (16, 64, 1), (80, 70, 130)]  # 80 rows: a prefill


@pytest.fixture(autouse=True, params=["kernel", "xla"])
def product_path(request):
  """Every test runs with the kernel (built on every machine with a C++ compiler) and without."""
  if request.param == "kernel":
    assert cpu_kernel.available(), cpu_kernel.describe()
    yield request.param
  else:
    with cpu_kernel.disabled():
      yield request.param


matmul = jax.jit(panels.matmul, static_argnames=("n", "dtype", "preferred_element_type"))


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_panel_product_equals_the_plain_one(m, k, n, dtype):
  rng = np.random.default_rng(m * 1000 + n)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)), dtype)
  wp = panels.pack(w)
  assert wp.shape == panels.packed_shape(k, n) == (-(-n // 64), k, 64)
  got = matmul(x, wp, n=n, preferred_element_type=jnp.float32)
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  # Inputs are exact in either dtype and products accumulate in float32: only rounding
  # of the sums differs from float64.
  np.testing.assert_allclose(np.asarray(got), exact, rtol=0, atol=1e-5 * k)
  if dtype == jnp.bfloat16:
    plain = jnp.matmul(x, w)  # the plain layout's product in the compute dtype
    np.testing.assert_allclose(
      np.asarray(matmul(x, wp, n=n), np.float32), np.asarray(plain, np.float32), rtol=2e-2
    )


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
  # So a verified tree node computes what a plain decoding step computes, bit for bit.
  rng = np.random.default_rng(0)
  for k, n in ((576, 192), (1536, 576), (100, 130)):
    w = panels.pack(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((16, k)), jnp.float32)
    alone = matmul(x[:1], w, n=n)
    for m in range(2, 17):
      assert (matmul(x[:m], w, n=n)[:1] == alone).all(), (k, n, m)


def test_pack_and_unpack_invert_each_other_on_leading_axes():
  w = jnp.arange(2 * 3 * 5 * 70, dtype=jnp.float32).reshape(2, 3, 5, 70)
  packed = panels.pack(w)
  assert packed.shape == (2, 3, 2, 5, 64)
  assert (packed[..., 1, :, 6:] == 0).all()  # the padding columns
  np.testing.assert_array_equal(panels.unpack(packed, 70), w)


# M rows, K inputs (multiples of the 32-weight quantisation block), N outputs.
BLOCK_SHAPES = [(1, 64, 130), (3, 96, 64), (8, 576, 192), (16, 32, 1), (80, 160, 70)]


@pytest.mark.parametrize("m,k,n", BLOCK_SHAPES)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_quantised_panels_hold_the_files_weights_and_multiply_as_the_kernel_does(
  m, k, n, kind, product_path
):
  rng = np.random.default_rng(m * 1000 + n)
  raw, w_KN = testing.gguf_blocks(rng, kind, k, n)
  wq = jnp.asarray(panels.pack_blocks(raw, kind, k, n))
  assert wq.dtype == jnp.uint8 and wq.shape == (-(-n // 64), k // 32, panels.BLOCK_BYTES[kind])
  wf = panels.pack(jnp.asarray(w_KN))
  bits = lambda a: np.asarray(a).view(np.uint32)
  np.testing.assert_array_equal(bits(panels.dequantize(wq)), bits(wf))  # GGUF's own weights
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  got = np.asarray(matmul(x, wq, n=n))
  if product_path == "kernel":  # llama.cpp's arithmetic, every row count (80: a prefill)
    want = testing.gguf_block_matmul(x, raw, kind, k, n)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    alone = np.stack([np.asarray(matmul(x[i : i + 1], wq, n=n))[0] for i in range(m)])
    np.testing.assert_array_equal(bits(got), bits(alone))
    # x quantised to 8 bits per 32: within a percent of the float product
    exact = np.asarray(x, np.float64) @ w_KN
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()
  else:  # XLA: the float panels of the dequantised weights
    np.testing.assert_array_equal(bits(got), bits(matmul(x, wf, n=n)))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_columns_taken_from_block_quantised_panels_keep_their_blocks(kind):
  raw, w_KN = testing.gguf_blocks(np.random.default_rng(1), kind, 96, 200)
  wq = jnp.asarray(panels.pack_blocks(raw, kind, 96, 200))
  for ids in ([199, 0, 63, 64, 130, 5, 5], list(range(200))[::-3]):
    taken = panels.take_columns(wq, jnp.asarray(ids))
    assert taken.dtype == jnp.uint8 and taken.shape == (-(-len(ids) // 64), 3, wq.shape[-1])
    want = panels.pack(jnp.asarray(w_KN[:, ids]))
    got = panels.dequantize(taken)[..., : want.shape[-2], :]
    np.testing.assert_array_equal(panels.unpack(got, len(ids)), panels.unpack(want, len(ids)))


def test_block_quantised_panels_of_an_unknown_type_or_width_are_one_clear_error():
  raw, _ = testing.gguf_blocks(np.random.default_rng(0), "Q4_1", 64, 8)
  with pytest.raises(ValueError, match="no block-quantised panels for GGUF type Q4_K"):
    panels.pack_blocks(raw, "Q4_K", 64, 8)
  with pytest.raises(ValueError, match="K must be a multiple of 32, got 48"):
    panels.pack_blocks(raw, "Q4_1", 48, 8)


@pytest.mark.parametrize("tied", [True, False])
def test_a_gguf_target_decodes_from_its_blocks_where_the_kernel_runs(tmp_path, tied, product_path):
  path = str(tmp_path / "blocks.gguf")
  testing.save_gguf_llama(path, tied=tied)
  decoding = checkpoints.load_target(path, weight_layout="decode")
  floats = checkpoints.load_target(path, weight_layout="panels", scan_layers=False, untie_head=True)
  quantised = {
    jax.tree_util.keystr(p)
    for p, x in jax.tree_util.tree_leaves_with_path(decoding.params)
    if x.dtype == jnp.uint8
  }
  if product_path == "kernel":  # every dense weight of the target, the head included
    assert len(quantised) == 7 * decoding.cfg.num_layers + 1 and "['lm_head']" in quantised
  else:  # XLA would widen every weight at every step: the float panels decode faster
    assert not quantised
  tokens = jnp.asarray([[1, 7, 129, 64, 0, 33, 5]], jnp.int32)
  bits = lambda a: np.asarray(a).view(np.uint32)
  got, want = _logits(decoding, tokens)[0], _logits(floats, tokens)[0]
  if quantised:  # x quantised to 8 bits per 32 k in every product: a few percent off (4% on
    # this random model, whose large weights make every layer's error grow)
    assert np.linalg.norm(got - want) <= 0.08 * np.linalg.norm(want)
  else:
    np.testing.assert_array_equal(bits(got), bits(want))
  ids = jnp.asarray([0, 63, 64, 129])
  np.testing.assert_array_equal(decoding.head_rows(ids), floats.head_rows(ids))
  # A restricted draft head: the head's own blocks, its columns of the whole head's logits.
  g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64)), jnp.float32)
  vocab = jnp.arange(129, 59, -1, dtype=jnp.int32)
  for t in (decoding, floats):
    drafter = drafter_lib.random_drafter("pspec", t, jax.random.key(1), draft_vocab_size=70)
    drafter = drafter.replace(vocab=vocab).with_head(t)
    assert (drafter.head.dtype == jnp.uint8) == (t is decoding and bool(quantised))
    np.testing.assert_array_equal(bits(drafter.logits(t, g)), bits(t.logits(g)[..., vocab]))
  plain = decoding.with_weight_layout("plain")
  want = floats.with_weight_layout("plain")
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), plain.params, want.params))


def _logits(target, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  features, (k, v) = target(tokens, positions)
  return target.logits(features), k


@pytest.mark.parametrize(
  "cfg",
  [
    testing.TINY,  # every width under one panel
    testing.TINY.replace(hidden_size=96, intermediate_size=200, vocab_size=300, head_dim=24),
    testing.TINY.replace(scan_layers=True, tie_embeddings=True),
  ],
)
def test_the_target_computes_the_same_logits_in_both_layouts(cfg):
  target = llama.Target(cfg=cfg, params=llama.init_params(cfg, jax.random.key(0)))
  packed = target.with_weight_layout("panels")
  assert packed.cfg.weight_layout == "panels"
  assert packed.with_weight_layout("panels") is packed
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
  (plain_logits, plain_k), (panel_logits, panel_k) = (
    _logits(target, tokens),
    _logits(packed, tokens),
  )
  np.testing.assert_allclose(panel_logits, plain_logits, rtol=0, atol=1e-5)
  np.testing.assert_allclose(panel_k, plain_k, rtol=0, atol=1e-5)
  ids = jnp.asarray([0, 5, cfg.vocab_size - 1])
  np.testing.assert_array_equal(packed.head_rows(ids), target.head_rows(ids))
  back = packed.with_weight_layout("plain")
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back.params, target.params))


def test_the_embedded_target_computes_the_same_logits_in_both_layouts(smollm2):
  target, _ = smollm2
  untied = llama.Target(
    cfg=target.cfg.replace(tie_embeddings=False),
    params=target.params | {"lm_head": target.params["embedding"].T},
  ).with_scan_layers(False)
  tokens = jnp.asarray([[1, 4093, 314, 253, 3263, 28, 1053, 30, 2]], jnp.int32)
  plain_logits, _ = _logits(untied, tokens)
  panel_logits, _ = _logits(untied.with_weight_layout("panels"), tokens)
  # float32 sums in another order over 30 layers, at logit magnitudes ~30.
  np.testing.assert_allclose(panel_logits, plain_logits, rtol=0, atol=2e-3)
  assert (panel_logits.argmax(-1) == plain_logits.argmax(-1)).all()


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
def test_drafter_files_hold_the_plain_layout(tmp_path, kind):
  target = testing.make_target(
    5.0, cfg=testing.TINY.replace(name="tiny-wide", hidden_size=80, head_dim=20)
  )
  packed_target = target.with_weight_layout("panels")
  drafter = drafter_lib.random_drafter(kind, packed_target, jax.random.key(3))
  assert drafter.cfg.weight_layout == "panels"
  plain = drafter_lib.random_drafter(kind, target, jax.random.key(3))
  assert drafter.with_weight_layout("plain").params.keys() == plain.params.keys()
  np.testing.assert_array_equal(
    flatten_util.ravel_pytree(drafter.with_weight_layout("plain").params)[0],
    flatten_util.ravel_pytree(plain.params)[0],
  )
  drafter_files.save_drafter(str(tmp_path), drafter)
  for loader_target, layout in ((target, "plain"), (packed_target, "panels")):
    loaded = drafter_files.load_drafter(str(tmp_path), loader_target)
    assert loaded.cfg.weight_layout == layout
    want = drafter if layout == "panels" else plain
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), loaded.params, want.params))


def test_a_bad_layout_is_one_clear_error():
  with pytest.raises(ValueError, match="weight_layout must be one of"):
    testing.TINY.replace(weight_layout="tiles")
  with pytest.raises(ValueError, match="unknown weight layout 'tiles'"):
    checkpoints.load_target("smollm2-135m-instruct", weight_layout="tiles")
  assert checkpoints.decode_layout() == "panels"  # the tests run on the CPU
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  assert checkpoints.decode_layout(mesh) == "plain"


def test_a_restricted_draft_head_gives_the_same_logits_in_both_layouts():
  target = testing.make_target(5.0, cfg=testing.TINY.replace(name="tiny-wide", vocab_size=150))
  packed = target.with_weight_layout("panels")
  vocab = jnp.asarray([149, 3, 77, 64, 63, 0, 128], jnp.int32)
  g = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 32)), jnp.float32)
  logits = []
  for t in (target, packed):
    drafter = drafter_lib.random_drafter("pspec", t, jax.random.key(1), draft_vocab_size=7)
    drafter = drafter.replace(vocab=vocab)
    logits += [drafter.logits(t, g), drafter.with_head(t).logits(t, g)]
  for other in logits[1:]:
    np.testing.assert_allclose(other, logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["pspec", "eagle", "medusa"])
def test_a_drafter_loaded_for_a_block_quantised_target_takes_q8_0_blocks(tmp_path, kind):
  path = str(tmp_path / "blocks.gguf")
  testing.save_gguf_llama(path, tied=False)
  target = checkpoints.load_target(path, weight_layout="decode")
  drafter = testing.drafter_for(kind, target)
  drafter_files.save_drafter(tmp_path / "d", drafter)
  loaded = drafter_files.load_drafter(tmp_path / "d", target)
  quantised = [x for x in jax.tree.leaves(loaded.params) if x.dtype == jnp.uint8]
  # Dense panels, where the target has blocks: pspec's and eagle's fuse and decoder layer,
  # medusa's heads.
  dense = 1 if kind == "medusa" else 8
  assert len(quantised) == (dense if target.keeps_blocks else 0)
  # Q8_0 rounds each weight by at most half its block's scale, max |w| / 127.
  got = flatten_util.ravel_pytree(loaded.with_weight_layout("plain").params)[0]
  want = flatten_util.ravel_pytree(drafter.with_weight_layout("plain").params)[0]
  assert np.abs(np.asarray(got - want)).max() <= np.abs(np.asarray(want)).max() / 254 * 1.01


def test_q8_0_quantisation_is_gguf_s():
  w = np.random.default_rng(0).standard_normal((96, 70)).astype(np.float32)
  raw = gguf.quants.quantize(np.ascontiguousarray(w.T), gguf.GGMLQuantizationType.Q8_0)
  np.testing.assert_array_equal(
    np.asarray(panels.quantize_q8_0(w)), panels.pack_blocks(raw, "Q8_0", 96, 70)
  )
