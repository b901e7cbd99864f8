"""The CPU kernels (`pspec_jax.cpu_kernel`: panel products and decoding attention) against
numpy, and XLA's path where they are off.

The kernel is built on every machine with a C++ compiler (`make setup`), so these tests expect
it; the fallback is tested in fresh processes where it is turned off or cannot be built.
"""

import itertools
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pspec_jax import cpu_kernel, layers, llama, panels, testing

# M rows, K inputs, N outputs: N and K on and off multiples of the 64-column panel and of the
# kernel's 64-row blocks, every M up to 16 and the most rows the kernel takes.
SHAPES = [(m, 96 + 37 * m, 50 + 61 * m) for m in range(1, 17)]
SHAPES += [(4, 576, 192), (6, 1536, 576), (cpu_kernel.MAX_ROWS, 129, 130), (3, 1, 1)]

kernel_matmul = jax.jit(cpu_kernel.matmul, static_argnums=2)


def _exact(x, w_KN):
  return np.asarray(x, np.float64) @ np.asarray(w_KN, np.float64)


@pytest.fixture(scope="module", autouse=True)
def _built():
  assert cpu_kernel.available(), cpu_kernel.describe()


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_equals_numpy(m, k, n, dtype):
  rng = np.random.default_rng(m * 7919 + k * 31 + n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), dtype)  # exact in either dtype from here on
  got = kernel_matmul(x, panels.pack(w), n)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  # float32 sums of k products: rounding only.
  np.testing.assert_allclose(np.asarray(got), _exact(x, w.astype(jnp.float32)), atol=2e-6 * k)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
  # Every M, every position in the row blocks: bit for bit the row computed alone.
  rng = np.random.default_rng(0)
  for k, n in ((576, 192), (1536, 130), (300, 64)):
    w = panels.pack(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((17, k)), jnp.float32)
    alone = np.stack([np.asarray(kernel_matmul(x[i : i + 1], w, n))[0] for i in range(17)])
    for m in range(2, 18):
      np.testing.assert_array_equal(np.asarray(kernel_matmul(x[:m], w, n)), alone[:m])


def test_panel_products_use_the_kernel_on_the_cpu_and_xla_past_its_rows():
  w = panels.pack(jnp.ones((64, 70), jnp.float32))

  def hlo(m):
    f = jax.jit(lambda x: panels.matmul(x, w, 70))
    return f.lower(jnp.ones((m, 64), jnp.float32)).as_text()

  assert "pspec_panel_matmul" in hlo(1) and "pspec_panel_matmul" in hlo(cpu_kernel.MAX_ROWS)
  assert "pspec_panel_matmul" not in hlo(cpu_kernel.MAX_ROWS + 1)  # a prefill: XLA's GEMM
  with cpu_kernel.disabled():
    assert not cpu_kernel.available()
    assert "pspec_panel_matmul" not in hlo(1)
  assert cpu_kernel.available()


def test_calls_from_several_threads_at_once_each_get_their_own_product():
  # XLA may run independent products at once; the second caller computes alone.
  rng = np.random.default_rng(1)
  k, n = 576, 1536
  w_KN = rng.standard_normal((k, n)).astype(np.float32)
  w = panels.pack(jnp.asarray(w_KN))
  xs = [jnp.asarray(rng.standard_normal((1 + i % 5, k)), jnp.float32) for i in range(8)]
  want = [np.asarray(kernel_matmul(x, w, n)) for x in xs]
  errors = []

  def run(i):
    for _ in range(20):
      if not np.array_equal(np.asarray(kernel_matmul(xs[i], w, n)), want[i]):
        errors.append(i)

  threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  np.testing.assert_allclose(want[0], _exact(xs[0], w_KN), atol=2e-6 * k)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_block_quantised_panels_equal_numpy_s_integer_arithmetic(kind):
  # Every M up to 16 and the most the kernel takes; K from one block to 5. x scaled over 8
  # orders of magnitude, with zero blocks (scale 0) and exact ties of the 8-bit rounding.
  rng = np.random.default_rng(len(kind))
  for m in [*range(1, 17), cpu_kernel.MAX_ROWS]:
    k, n = 32 * (1 + m % 5), 40 + 23 * m
    raw, w_KN = testing.gguf_blocks(rng, kind, k, n)
    x = rng.standard_normal((m, k)) * 10.0 ** rng.integers(-4, 4, (m, 1))
    x[0, :32] = 0.0
    x[-1, :32] = np.arange(32) - 15.5  # x / dx lands on halves: rounded to even
    x = jnp.asarray(x, jnp.float32)
    got = np.asarray(kernel_matmul(x, jnp.asarray(panels.pack_blocks(raw, kind, k, n)), n))
    want = testing.gguf_block_matmul(x, raw, kind, k, n)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_reading_ahead_changes_no_product_even_of_weights_freed_since():
  # The kernel threads bring the weights of the call that came next last time into cache:
  # the products are the same bits with or without it, where the remembered weights are freed
  # (their memory asked for all the same) and over more calls than are remembered.
  rng = np.random.default_rng(11)
  k, n = 96, 130
  x = jnp.asarray(rng.standard_normal((4, k)), jnp.float32)

  def blocks():
    raw, _ = testing.gguf_blocks(rng, "Q4_1", k, n)
    return raw, jnp.asarray(panels.pack_blocks(raw, "Q4_1", k, n))

  (raw_a, a), (raw_b, b) = blocks(), blocks()
  want_a = np.asarray(kernel_matmul(x, a, n))
  np.testing.assert_allclose(want_a, testing.gguf_block_matmul(x, raw_a, "Q4_1", k, n), rtol=1e-6)
  before = cpu_kernel.read_ahead(1 << 20)
  try:
    for _ in range(3):  # a after b, then b after a: each call reads the other ahead
      jax.block_until_ready(kernel_matmul(x, b, n))
      np.testing.assert_array_equal(np.asarray(kernel_matmul(x, a, n)), want_a)
    want_b = testing.gguf_block_matmul(x, raw_b, "Q4_1", k, n)
    np.testing.assert_allclose(np.asarray(kernel_matmul(x, b, n)), want_b, rtol=1e-6)
    del b  # freed: the call after a read b's memory ahead last time
    np.testing.assert_array_equal(np.asarray(kernel_matmul(x, a, n)), want_a)
    others = [a + i for i in range(1, 4200)]  # past the 4096 calls a thread remembers
    for w in others:
      jax.block_until_ready(kernel_matmul(x, w, n))
    del others
    np.testing.assert_array_equal(np.asarray(kernel_matmul(x, a, n)), want_a)
    cpu_kernel.read_ahead(0)
    np.testing.assert_array_equal(np.asarray(kernel_matmul(x, a, n)), want_a)
  finally:
    cpu_kernel.read_ahead(before)
  with pytest.raises(ValueError, match=">= 0 bytes"):
    cpu_kernel.read_ahead(-1)


def test_weights_of_another_type_or_block_size_are_one_clear_error():
  x = jnp.ones((2, 64), jnp.float32)
  for w in (jnp.ones((1, 2, 1000), jnp.uint8), jnp.ones((1, 64, 64), jnp.int32)):
    with pytest.raises(Exception, match="Q4_1 or Q8_0 blocks"):
      jax.block_until_ready(cpu_kernel.matmul(x, w, 64))


def test_too_many_rows_is_one_clear_error():
  with pytest.raises(ValueError, match="1 to 64 rows"):
    cpu_kernel.matmul(jnp.ones((65, 8)), panels.pack(jnp.ones((8, 8))), 8)


def test_weights_in_one_call_compute_what_each_computes_alone():
  # A layer's q, k, v (or gate, up) share one call: float32 and bfloat16 weights, widths on and
  # off the panel, through the kernel and through `layers.dense_many` in panels.
  rng = np.random.default_rng(5)
  k = 300
  widths, dtypes = (576, 192, 130, 64), (jnp.float32, jnp.bfloat16, jnp.float32, jnp.bfloat16)
  weights = [
    panels.pack(jnp.asarray(rng.standard_normal((k, n)), dt))
    for n, dt in zip(widths, dtypes, strict=True)
  ]
  pairs = list(zip(weights, widths, strict=True))
  cfg = llama.LlamaConfig(
    vocab_size=8, hidden_size=k, intermediate_size=8, num_layers=1, num_heads=1,
    num_kv_heads=1, head_dim=2, weight_layout="panels",
  )  # fmt: skip
  dense = jax.jit(lambda x, *ws: layers.dense_many(cfg, x, list(zip(ws, widths, strict=True))))
  for m in (1, 5, 17):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    together = jax.jit(lambda x, *ws: cpu_kernel.matmuls(x, list(zip(ws, widths, strict=True))))(
      x, *weights
    )
    for got, (w, n) in zip(together, pairs, strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel_matmul(x, w, n)))
    for got, (w, n) in zip(dense(x, *weights), pairs, strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel_matmul(x, w, n)))
  with pytest.raises(ValueError, match="1 to 4 weights"):
    cpu_kernel.matmuls(x, pairs + pairs[:1])


_CHECK = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, numpy as np
  from pspec_jax import cpu_kernel, panels
  rng = np.random.default_rng(2)
  w_KN = rng.standard_normal((300, 130)).astype(np.float32)
  w = panels.pack(jnp.asarray(w_KN))
  x = rng.standard_normal((9, 300)).astype(np.float32)
  f = jax.jit(lambda x: panels.matmul(x, w, 130))
  got = np.asarray(f(jnp.asarray(x)))
  np.testing.assert_allclose(got, x.astype(np.float64) @ w_KN, atol=1e-3)
  alone = np.asarray(f(jnp.asarray(x[4:5])))
  assert np.array_equal(got[4:5], alone)
  # Block-quantised panels: with the kernel, numpy's integer arithmetic (`gguf_block_matmul`),
  # a row alone as in company; without it, the float panels of the dequantised weights.
  from pspec_jax import testing
  for kind in ("Q4_1", "Q8_0"):
    raw, w_KN = testing.gguf_blocks(rng, kind, 320, 130)
    q = jnp.asarray(panels.pack_blocks(raw, kind, 320, 130))
    xq = rng.standard_normal((9, 320)).astype(np.float32)
    product = jax.jit(lambda x, w: panels.matmul(x, w, 130))
    got = np.asarray(product(xq, q))
    if cpu_kernel.available():
      want = testing.gguf_block_matmul(xq, raw, kind, 320, 130)
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
      assert np.array_equal(got[4:5], np.asarray(product(xq[4:5], q))), kind
    else:
      want = np.asarray(product(xq, panels.pack(jnp.asarray(w_KN))))
      assert np.array_equal(got, want), kind
  # Decoding attention: its own answer against numpy's, on the ISA and threads of the run.
  from tests.cpu_kernel_test import attention_case, numpy_attention, tree_node_and_plain_step
  for h in (64, 80, 12):
    args, scale = attention_case(np.random.default_rng(h), 2, 3, 9, 3, 2, h)
    want = numpy_attention(*args, scale)
    if cpu_kernel.available():
      got = cpu_kernel.attention(*map(jnp.asarray, args), scale)
      np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
      tree, plain = tree_node_and_plain_step(h)
      assert np.array_equal(tree, plain), h
  # Vocabulary rows: argmax exact, softmax close, draws numpy's inverse distribution function.
  if cpu_kernel.available():
    x = (rng.standard_normal((3, 1001)) * 4).astype(np.float32)
    x[:, ::7] = -np.inf
    assert np.array_equal(np.asarray(cpu_kernel.argmax(x)), np.argmax(x, -1))
    got = np.asarray(cpu_kernel.softmax(x))
    np.testing.assert_allclose(got, jax.nn.softmax(x, -1), rtol=2e-6, atol=1e-9)
    bits = rng.integers(0, 2**32, (3, 4, 2), dtype=np.uint64).astype(np.uint32)
    drawn = np.asarray(cpu_kernel.draws(x, bits))
    for r in range(3):
      mass = np.exp(x[r].astype(np.float64) - x[r].max())
      for j in range(4):
        u = ((int(bits[r, j, 0]) << 21) | (int(bits[r, j, 1]) >> 11)) * 2.0**-53
        want = int(np.searchsorted(np.cumsum(mass), u * mass.sum(), side="right"))
        assert drawn[r, j] == want, (r, j, drawn[r], want)
        mass[want] = 0
    # A level of recursive rejection: the walk's equations in float64 (`numpy_rejection`).
    from tests.cpu_kernel_test import numpy_rejection
    logq = np.log(rng.dirichlet(np.ones(1001), 3)).astype(np.float32)
    tokens = np.argsort(-logq, axis=1)[:, :2].astype(np.int32)
    uniform = rng.random(tokens.shape).astype(np.float32)
    got = cpu_kernel.rejection(x, logq, tokens, np.ones_like(tokens), uniform, bits[:, 0])
    for r in range(3):
      *want, margin = numpy_rejection(x[r], logq[r], tokens[r], [1, 1], uniform[r], bits[r, 0])
      assert margin < 1e-4 or [int(a[r]) for a in got] == want, (r, want)
  print(cpu_kernel.describe(), "custom call" in f.lower(jnp.asarray(x)).as_text().replace(
      "pspec_panel_matmul", "custom call"))
  """
)


def _run(**env):
  done = subprocess.run(
    [sys.executable, "-c", _CHECK],
    env=testing.cli_env() | env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr
  return done.stdout.strip(), done.stderr


def test_the_portable_path_and_one_thread_give_the_same_products():
  out, _ = _run(
    PSPEC_JAX_CPU_KERNEL_ISA="portable",
    PSPEC_JAX_CPU_KERNEL_THREADS="1",
    PSPEC_JAX_CPU_KERNEL_READ_AHEAD="65536",
  )
  assert out == "CPU kernels (portable, 1 threads, read-ahead 64 KB) True"


_PRODUCTS = textwrap.dedent(
  """
  import sys, jax, jax.numpy as jnp, numpy as np
  from pspec_jax import cpu_kernel, panels, testing
  rng = np.random.default_rng(3)
  out = {"isa": np.array(cpu_kernel.describe())}
  for m, k, n, dt in ((1, 576, 192, jnp.float32), (7, 300, 130, jnp.bfloat16),
                      (13, 1536, 576, jnp.float32), (16, 129, 64, jnp.bfloat16)):
    w = panels.pack(jnp.asarray(rng.standard_normal((k, n)), dt))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    out[f"{m}"] = np.asarray(jax.jit(cpu_kernel.matmul, static_argnums=2)(x, w, n))
  # AMX takes 9 to 16 rows, VNNI fewer and more
  for m, k, n, kind in ((1, 576, 192, "Q4_1"), (3, 64, 64, "Q4_1"), (16, 1536, 576, "Q4_1"),
                        (17, 64, 130, "Q4_1"), (1, 320, 200, "Q8_0"), (4, 128, 70, "Q8_0"),
                        (9, 96, 130, "Q8_0")):
    raw, _ = testing.gguf_blocks(rng, kind, k, n)
    w = jnp.asarray(panels.pack_blocks(raw, kind, k, n))
    # rows of different scales: x's quantisation rounds at every magnitude
    x = rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))
    x = jnp.asarray(x, jnp.float32)
    out[f"{kind} {m}"] = np.asarray(jax.jit(cpu_kernel.matmul, static_argnums=2)(x, w, n))
  np.savez(sys.argv[1], **out)
  """
)


def test_every_instruction_set_gives_the_same_bits(tmp_path):
  # Block-quantised panels: the same integer sums and float updates on every path (AMX's tiles,
  # AVX-512 VNNI, AVX2, portable C++), so a GGUF target decodes to the same bits on any x86-64
  # CPU. Float panels: one fused multiply-add per k in k order on AVX-512 and AVX2 (portable
  # C++ multiplies, then adds). A calibration or a decode on either computes the same products.
  # The runs that name an instruction set use 8 threads, more than a CI machine's cores: the
  # products do not depend on the threads, nor on how their waits give way to each other.
  got = {}
  for isa in ("", "avx512", "avx2", "portable"):
    path = tmp_path / f"{isa or 'default'}.npz"
    env = testing.cli_env() | {"PSPEC_JAX_CPU_KERNEL_ISA": isa}
    if isa:
      env["PSPEC_JAX_CPU_KERNEL_THREADS"] = "8"
    done = subprocess.run([sys.executable, "-c", _PRODUCTS, path], env=env, timeout=300)
    assert done.returncode == 0
    got[isa] = dict(np.load(path))
  assert "(portable, 8 threads," in str(got["portable"].pop("isa"))
  assert "(avx2, 8 threads," in str(got["avx2"].pop("isa"))
  assert "+amx" not in str(got["avx512"].pop("isa"))
  default = str(got[""].pop("isa"))
  quantised = [name for name in got["portable"] if name.startswith("Q")]
  assert len(quantised) == 7
  for isa, name in itertools.product(("", "avx512", "avx2"), quantised):
    np.testing.assert_array_equal(got[isa][name], got["portable"][name], err_msg=f"{isa} {name}")
  # Without AVX-512 the default run took the AVX2 path (on its own threads), and so did "avx512".
  same_floats = ("", "avx512") if "(avx512" in default else ("",)
  for isa, (m, product) in itertools.product(same_floats, got["avx2"].items()):
    np.testing.assert_array_equal(got[isa][m], product, err_msg=f"{isa} {m}")


def test_turned_off_panel_products_take_xla_and_stay_right():
  out, _ = _run(PSPEC_JAX_CPU_KERNEL="off")
  assert out == "XLA (no CPU kernels) False"


@pytest.mark.parametrize("cxx", ["no-such-compiler", "false"])
def test_without_a_working_compiler_panel_products_take_xla_and_say_why(tmp_path, cxx):
  out, err = _run(PSPEC_JAX_CACHE=str(tmp_path), CXX=cxx)
  assert out == "XLA (no CPU kernels) False"
  why = "no C++ compiler" if cxx == "no-such-compiler" else "building the CPU panel kernel failed"
  assert f"CPU panel kernel unavailable, using XLA: {why}" in err
  assert not [f for _, _, files in os.walk(tmp_path) for f in files]  # nothing half-built


# --- decoding attention ---------------------------------------------------------------------


def attention_case(rng, b, t, s, kv, g, h):
  """Random attention inputs (`cpu_kernel.attention`'s order) with ragged cache lengths (one of
  them 0), a random mask over the new tokens and one new token that sees nothing."""
  q = rng.standard_normal((b, t, kv, g, h)).astype(np.float32)
  k_cache, v_cache = rng.standard_normal((2, b, s, kv, h)).astype(np.float32)
  k_new, v_new = rng.standard_normal((2, b, t, kv, h)).astype(np.float32)
  cache_len = rng.integers(0, s + 1, b).astype(np.int32)
  cache_len[0] = 0
  mask = rng.random((b, t, t)) < 0.6
  mask[0, t - 1] = False  # with cache_len 0: sees nothing at all (a padding row)
  return (q, k_cache, v_cache, cache_len, k_new, v_new, mask), 1.0 / np.sqrt(h)


def numpy_attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale):
  """The definition, in float64: scores over [cache slots, new tokens], hidden ones at float32's
  lowest, softmax, weighted values (a row that sees nothing averages every slot)."""
  b, t, kv, g, h = q.shape
  s = k_cache.shape[1]
  keys = np.concatenate([k_cache, k_new], axis=1).astype(np.float64)  # [B, S+T, KV, H]
  values = np.concatenate([v_cache, v_new], axis=1).astype(np.float64)
  scores = np.einsum("btkgh,bukh->btkgu", q.astype(np.float64), keys) * scale
  visible = np.concatenate(
    [np.broadcast_to((np.arange(s)[None, :] < cache_len[:, None])[:, None], (b, t, s)), mask], -1
  )
  scores = np.where(visible[:, :, None, None], scores, np.finfo(np.float32).min)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("btkgu,bukh->btkgh", weights, values)


ATTENTION_SHAPES = [  # B, T, S, KV, G, H: one token or a tree; H off a multiple of 8 (portable)
  (1, 1, 7, 3, 3, 64),
  (2, 5, 33, 3, 3, 64),
  (3, 8, 20, 2, 4, 128),
  (1, 16, 0, 1, 2, 64),
  (2, 3, 9, 3, 1, 12),
  (2, 4, 40, 2, 3, 80),  # H = 80: a last 16 columns alone on AVX-512
]


@pytest.mark.parametrize("b,t,s,kv,g,h", ATTENTION_SHAPES)
def test_decoding_attention_equals_numpy_and_xla(b, t, s, kv, g, h):
  from pspec_jax import layers

  args, scale = attention_case(np.random.default_rng(b * 100 + t * 10 + s), b, t, s, kv, g, h)
  got = np.asarray(jax.jit(cpu_kernel.attention, static_argnums=7)(*args, scale))
  np.testing.assert_allclose(got, numpy_attention(*args, scale), atol=2e-5, rtol=2e-5)
  q, k_cache, v_cache, cache_len, k_new, v_new, mask = map(jnp.asarray, args)
  xla = layers._attend(testing.TINY, q, k_new, v_new, mask, (k_cache, v_cache), cache_len)
  np.testing.assert_allclose(got, np.asarray(xla), atol=2e-5, rtol=2e-5)


def tree_node_and_plain_step(h: int, cached: int = 40, depth: int = 3):
  """A tree node's attention and a plain step's, which must be the same bits: in the plain step
  the node's ancestors are in the cache; in the verification they are new tokens beside other
  tree nodes the node does not see. The same keys in the same order."""
  rng = np.random.default_rng(5)
  kv, g = 3, 3
  k_all, v_all = rng.standard_normal((2, 1, cached + depth + 1, kv, h)).astype(np.float32)
  q = rng.standard_normal((1, 1, kv, g, h)).astype(np.float32)
  s = cached + depth + 21  # cache capacity, past the lengths used
  pad = lambda x: np.pad(x, ((0, 0), (0, s - x.shape[1]), (0, 0), (0, 0)))
  plain = cpu_kernel.attention(
    q,
    pad(k_all[:, : cached + depth]),
    pad(v_all[:, : cached + depth]),
    np.array([cached + depth], np.int32),
    k_all[:, -1:],
    v_all[:, -1:],
    np.ones((1, 1, 1), bool),
    1 / 8,
  )
  # The tree: 2 siblings the node does not see, then its ancestors, then the node itself.
  sibs = rng.standard_normal((2, 1, 2, kv, h)).astype(np.float32)
  k_new = np.concatenate([sibs[0], k_all[:, cached:]], axis=1)
  v_new = np.concatenate([sibs[1], v_all[:, cached:]], axis=1)
  t = k_new.shape[1]
  mask = np.tril(np.ones((t, t), bool))[None]
  mask[0, -1, :2] = False
  q_tree = np.broadcast_to(q, (1, t, kv, g, h)).copy()
  tree = cpu_kernel.attention(
    q_tree,
    pad(k_all[:, :cached]),
    pad(v_all[:, :cached]),
    np.array([cached], np.int32),
    k_new,
    v_new,
    mask,
    1 / 8,
  )
  return np.asarray(tree)[:, -1], np.asarray(plain)[:, 0]


@pytest.mark.parametrize(
  "h,cached,depth", [(64, 40, 3), (64, 13, 2), (128, 30, 5), (80, 16, 4), (48, 0, 1)]
)
def test_a_tree_node_attends_bit_for_bit_as_a_plain_step(h, cached, depth):
  # 16 keys at a time (AVX-512): the node's keys sit at other places among the 16 in each pass.
  tree, plain = tree_node_and_plain_step(h, cached, depth)
  np.testing.assert_array_equal(tree, plain)


def test_decoding_with_panel_weights_takes_the_attention_kernel():
  from pspec_jax import decode

  target = testing.make_target(1.0).with_weight_layout("panels")
  tokens, lengths = testing.padded([[3, 1, 4]], width=8)
  cfg = decode.DecodeConfig(max_new_tokens=4)
  hlo = lambda t: (
    jax.jit(lambda: decode.generate(t, tokens, lengths, jax.random.key(0), cfg, None).tokens)
    .lower()
    .as_text()
  )
  assert "pspec_decode_attention" in hlo(target)
  assert "pspec_decode_attention" not in hlo(target.with_weight_layout("plain"))
  with cpu_kernel.disabled():
    assert "pspec_decode_attention" not in hlo(target)


def test_attention_of_more_new_tokens_than_the_kernel_takes_is_xla_s():
  from pspec_jax import layers

  cfg = testing.TINY.replace(weight_layout="panels")
  kv, g, h = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim

  def hlo(t):
    q, new = jnp.zeros((1, t, kv, g, h)), jnp.zeros((1, t, kv, h))
    cache = (jnp.zeros((1, 8, kv, h)), jnp.zeros((1, 8, kv, h)))
    mask, lengths = jnp.ones((1, t, t), bool), jnp.ones((1,), jnp.int32)
    f = jax.jit(lambda q: layers.attend(cfg, q, new, new, mask, cache, lengths))
    return f.lower(q).as_text()

  assert "pspec_decode_attention" in hlo(cpu_kernel.MAX_ROWS)
  assert "pspec_decode_attention" not in hlo(cpu_kernel.MAX_ROWS + 1)  # a prefill


def test_the_cpu_branch_is_traced_alone_where_the_cpu_is_the_only_platform(monkeypatch):
  traced = []

  def branch(name, scale):
    def f(x):
      traced.append(name)
      return x * scale

    return f

  def run():
    traced.clear()
    fn = lambda x: cpu_kernel.platform_dependent(x, cpu=branch("cpu", 2), default=branch("else", 3))
    return float(jax.jit(fn)(jnp.ones(())))

  assert run() == 2 and traced == ["cpu"]
  # With an accelerator the program may lower for it: both branches are traced, and the CPU's
  # runs on the CPU.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert run() == 2 and sorted(traced) == ["cpu", "else"]


# Vocabulary rows: argmax, softmax and draws without replacement.


def _logits(rng, shape, ties=False):
  x = rng.integers(-3, 4, shape) if ties else rng.standard_normal(shape) * 4
  x = x.astype(np.float32)
  x[rng.random(shape) < 0.2] = -np.inf
  return x


@pytest.mark.parametrize("shape", [(1, 49152), (3, 1000), (2, 7), (5, 17), (2, 3, 33)])
@pytest.mark.parametrize("ties", [False, True])
def test_vocabulary_argmax_is_jnp_argmax(shape, ties):
  x = _logits(np.random.default_rng(len(shape) + shape[-1]), shape, ties)
  got = np.asarray(jax.jit(cpu_kernel.argmax)(x))
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
  assert got.dtype == np.int32 and got.shape == shape[:-1]
  # A row without a finite logit: token 0, as jnp.argmax.
  assert np.asarray(cpu_kernel.argmax(np.full((2, 9), -np.inf, np.float32))).tolist() == [0, 0]


@pytest.mark.parametrize("shape", [(1, 49152), (3, 1000), (2, 7), (2, 3, 33)])
def test_vocabulary_softmax_is_jax_nn_softmax(shape):
  x = _logits(np.random.default_rng(shape[-1]), shape)
  got = np.asarray(jax.jit(cpu_kernel.softmax)(x))
  np.testing.assert_allclose(got, jax.nn.softmax(x, axis=-1), rtol=2e-6, atol=1e-9)
  assert (got[x == -np.inf] == 0).all()
  np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(cpu_kernel.softmax(np.full((1, 5), -np.inf, np.float32)), 0.0)


def _bits(key, shape):
  return jax.random.bits(key, shape, jnp.uint32)


def test_draws_without_replacement_follow_the_softmax_in_the_order_drawn():
  import scipy.stats

  logits = np.array([1.0, 2.0, -np.inf, 0.5, 3.0, -1.0], np.float32)
  p = np.exp(logits.astype(np.float64) - logits.max())
  p /= p.sum()
  n = 60000
  keys = jax.vmap(jax.random.key)(jnp.arange(n))
  bits = jax.vmap(lambda k: _bits(k, (3, 2)))(keys)
  drawn = np.asarray(cpu_kernel.draws(np.broadcast_to(logits, (n, 6)), bits))
  assert drawn.shape == (n, 3) and drawn.dtype == np.int32
  assert (drawn != 2).all()  # a -inf logit is never drawn
  assert (drawn[:, 0] != drawn[:, 1]).all() and (drawn[:, 1] != drawn[:, 2]).all()
  assert (drawn[:, 0] != drawn[:, 2]).all()
  # The ordered pair (first, second): p_i p_j / (1 - p_i), sampling without replacement.
  pairs = [(i, j) for i in range(6) for j in range(6) if i != j and p[i] > 0 and p[j] > 0]
  want = np.array([p[i] * p[j] / (1 - p[i]) for i, j in pairs])
  index = {pair: k for k, pair in enumerate(pairs)}
  counts = np.bincount([index[tuple(d)] for d in drawn[:, :2].tolist()], minlength=len(pairs))
  assert scipy.stats.chisquare(counts, want / want.sum() * n).pvalue > 1e-3


def test_draws_at_the_ends_of_the_unit_interval_and_past_the_tokens_with_mass():
  x = np.array([[-np.inf, 0.0, 1.0, -np.inf, 2.0, -np.inf]], np.float32)
  zeros = np.zeros((1, 1, 2), np.uint32)
  ones = np.full((1, 1, 2), 0xFFFFFFFF, np.uint32)
  assert np.asarray(cpu_kernel.draws(x, zeros)).tolist() == [[1]]  # u = 0: the first of mass
  assert np.asarray(cpu_kernel.draws(x, ones)).tolist() == [[4]]  # u -> 1: the last of mass
  # More draws than tokens of mass: every such token once, then the last one again.
  got = np.asarray(cpu_kernel.draws(x, np.zeros((1, 5, 2), np.uint32)))[0]
  assert sorted(got[:3].tolist()) == [1, 2, 4] and (got[3:] == got[2]).all()
  # Logits beyond exp's range below the max: weighed again once the others are drawn, as
  # Gumbel-top-k would draw them; +inf logits share all the mass.
  far = np.array([[0.0, -200.0, -100.0, -np.inf, -300.0]], np.float32)
  assert np.asarray(cpu_kernel.draws(far, np.zeros((1, 4, 2), np.uint32))).tolist() == [
    [0, 2, 1, 4]
  ]
  inf = np.array([[np.inf, 0.0, np.inf, -np.inf]], np.float32)
  assert sorted(np.asarray(cpu_kernel.draws(inf, ones.repeat(2, 1)))[0].tolist()) == [0, 2]
  np.testing.assert_array_equal(cpu_kernel.softmax(inf), [[0.5, 0.0, 0.5, 0.0]])
  # A row without a finite logit draws token 0 (as jax.random.categorical).
  none = np.full((2, 4), -np.inf, np.float32)
  assert np.asarray(cpu_kernel.draws(none, np.zeros((2, 2, 2), np.uint32))).tolist() == [[0, 0]] * 2


def _unit(bits):
  return ((int(bits[0]) << 21) | (int(bits[1]) >> 11)) * 2.0**-53


def numpy_rejection(x, logq, tokens, from_q, uniform, bits):
  """One level of recursive rejection in float64: (slot, bonus, margin), margin the smallest
  relative distance of a decision (an acceptance, or the bonus's place in the distribution
  function) from its threshold, where float32 rounding may decide otherwise."""
  mass = lambda z: np.exp(z.astype(np.float64) - z.max()) if np.isfinite(z).any() else 0 * z
  r, q = mass(x), mass(logq)
  margin = np.inf
  for c, (t, drawn, u) in enumerate(zip(tokens, from_q, uniform, strict=True)):
    if t < 0 or (drawn and q[t] == 0):
      continue
    pi = q[t] / q.sum() if drawn else 1.0
    bar, got = u * r.sum() * pi, r[t]
    margin = min(margin, abs(bar - got) / max(got, 1e-300))
    if got > 0 and bar < got:
      return c, -1, margin
    r = np.maximum(r / r.sum() - (q / q.sum() if drawn else np.eye(len(r))[t]), 0)
    if drawn:
      q[t] = 0
  if not r.sum() > 0:
    r = mass(x)
  if not np.sum(r) > 0:
    return -1, 0, margin
  cdf = np.cumsum(r) / r.sum()
  bonus = int(np.searchsorted(cdf, _unit(bits), side="right"))
  gaps = np.abs(cdf - _unit(bits))
  return -1, bonus, min(margin, gaps.min() / max(r[bonus] / r.sum(), 1e-300))


@pytest.mark.parametrize("vocab", [7, 33, 1000])
def test_a_rejection_level_is_numpy_s(vocab):
  """`cpu_kernel.rejection` against the walk's equations in float64, draw by draw: children drawn
  from q and point masses, in every order, on rows with -inf logits; decisions within rounding
  of their threshold are left out (at most a few)."""
  rng = np.random.default_rng(vocab)
  rows, children = 400, 3
  x = _logits(rng, (rows, vocab))
  logq = np.log(rng.dirichlet(np.ones(vocab) * 0.5, rows)).astype(np.float32)
  # Children: q's likeliest tokens (so drafts are often accepted), random ones, or none.
  tokens = np.argsort(-logq, axis=1)[:, :children].astype(np.int32)
  tokens = np.where(rng.random(tokens.shape) < 0.3, rng.integers(0, vocab, tokens.shape), tokens)
  tokens[rng.random(tokens.shape) < 0.15] = -1
  from_q = (rng.random(tokens.shape) < 0.7).astype(np.int32)
  uniform = rng.random(tokens.shape).astype(np.float32)
  bits = rng.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32)
  slot, bonus = map(
    np.asarray, jax.jit(cpu_kernel.rejection)(x, logq, tokens, from_q, uniform, bits)
  )
  assert slot.shape == bonus.shape == (rows,) and slot.dtype == bonus.dtype == np.int32
  compared = 0
  outcomes = set()
  for i in range(rows):
    want_slot, want_bonus, margin = numpy_rejection(
      x[i], logq[i], tokens[i], from_q[i], uniform[i], bits[i]
    )
    if margin < 1e-4:
      continue
    compared += 1
    assert (slot[i], bonus[i]) == (want_slot, want_bonus), (i, tokens[i], from_q[i])
    outcomes.add("accepted" if want_slot >= 0 else "bonus")
  assert compared > rows * 0.9 and outcomes == {"accepted", "bonus"}


def test_a_rejection_level_at_its_edges():
  x = np.array([[0.0, 1.0, -np.inf, 2.0]], np.float32)
  logq = np.array([[np.log(0.5), np.log(0.5), -np.inf, -np.inf]], np.float32)
  zero, one = np.zeros((1, 2), np.uint32), np.full((1, 2), 0xFFFFFFFF, np.uint32)
  level = lambda tokens, from_q, u, bits: tuple(
    int(a[0])
    for a in cpu_kernel.rejection(
      x, logq, np.asarray([tokens], np.int32), np.asarray([from_q], np.int32),
      np.asarray([u], np.float32), bits,
    )
  )  # fmt: skip
  # No child: the bonus is drawn from softmax(x) (u = 0: the first token of mass; u -> 1: the
  # last), never a -inf token.
  assert level([-1], [1], [0.0], zero) == (-1, 0) and level([-1], [1], [0.0], one) == (-1, 3)
  # A drawn child of no q mass is not tried; a point mass is, with probability r(x) / sum(r).
  assert level([3], [1], [0.0], one) == (-1, 3)
  assert level([3], [0], [0.0], one) == (0, -1)
  # A rejected point mass leaves the residual without it (u -> 1: its last token, 1); a drawn
  # child rejected leaves max(0, r - pi), here r = (0.09, 0.24, 0, 0.67) less (0.5, 0.5, 0, 0):
  # token 3 alone.
  assert level([3], [0], [1.0 - 2**-24], one) == (-1, 1)
  assert level([0], [1], [1.0 - 2**-24], zero) == (-1, 3)
  # A row without a finite logit: token 0, as jax.random.categorical.
  none = np.full((1, 4), -np.inf, np.float32)
  level = lambda *a: tuple(int(b[0]) for b in cpu_kernel.rejection(none, logq, *a))
  assert level(
    np.full((1, 1), 2, np.int32), np.zeros((1, 1), np.int32), np.zeros((1, 1)), zero
  ) == (
    -1,
    0,
  )
  with pytest.raises(ValueError, match="rejection takes"):
    cpu_kernel.rejection(
      x, logq, np.zeros((1, 2), np.int32), np.zeros((1, 1)), np.zeros((1, 1)), zero
    )


def test_vocabulary_rows_are_one_clear_error_when_misshapen():
  with pytest.raises(ValueError, match="vocabulary axis"):
    cpu_kernel.argmax(np.zeros((2, 0), np.float32))


def test_rope_cos_sin_are_xla_s_bits_and_one_call_per_pass():
  # XLA's path (sharded, or without the kernels) must compute the same model: the same bits.
  angles = np.random.RandomState(0).uniform(-9000, 9000, (4, 512, 1, 64)).astype(np.float32)
  angles[0, 0, 0, :4] = [0.0, -0.0, 1e-30, np.pi]
  cos, sin = jax.jit(cpu_kernel.rope_cos_sin)(angles)
  xla_cos, xla_sin = jax.jit(lambda a: (jnp.cos(a), jnp.sin(a)))(angles)
  np.testing.assert_array_equal(cos, xla_cos)
  np.testing.assert_array_equal(sin, xla_sin)
  # In the decoding layout every layer's q and k take cos and sin from one call, which XLA
  # had fused into each rotation (computing them again for every head of every layer).
  target = testing.make_target(1.0, seed=0, cfg=testing.TINY).with_weight_layout("panels")
  tokens = jnp.asarray([[3, 1, 4, 1, 5]])
  positions = jnp.arange(5)[None]
  program = jax.jit(lambda t: target(t, positions)[0]).lower(tokens).compile().as_text()
  assert program.count("pspec_rope_cos_sin") == 1 and "cosine(" not in program
  with cpu_kernel.disabled():
    expected = target(tokens, positions)[0]
  np.testing.assert_allclose(target(tokens, positions)[0], expected, rtol=2e-5, atol=2e-5)
