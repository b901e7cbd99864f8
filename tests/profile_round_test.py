"""`infer.profile_round`'s parts on a random target, and the timings it shares with the bench."""

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import pytest

from infer import measure, profile_round
from pspec_jax import cpu_kernel, decode, presets, testing

# The decoding tests' tiny architecture with a larger vocabulary; a test ties its head, which
# the random target unties.
_NOT_ARCHITECTURE = ("name", "scan_layers", "weight_layout", "dtype", "param_dtype")
TINY_ARCH = {
  k: v for k, v in dataclasses.asdict(testing.TINY).items() if k not in _NOT_ARCHITECTURE
}
TINY_ARCH["vocab_size"] = 64


@pytest.mark.parametrize("layout", ["plain", "panels"])
def test_a_random_target_has_the_published_size_without_allocating_it(layout):
  shapes = jax.eval_shape(lambda: profile_round.random_target("llama2_7b", jnp.bfloat16, layout))
  assert shapes.cfg.weight_layout == layout
  leaves = jax.tree.leaves(shapes.params)
  assert round(sum(x.size for x in leaves) / 1e9, 2) == 6.74  # Llama-2-7B
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  assert not shapes.cfg.scan_layers  # the decoding layout


def test_an_unknown_architecture_is_one_clear_error():
  with pytest.raises(ValueError, match="unknown architecture 'llama9'.*llama2_7b"):
    profile_round.load("random:llama9", jnp.float32, "plain", 1, 8)


def test_a_random_target_profiles_round_parts_loop_and_step(monkeypatch):
  monkeypatch.setitem(presets.ARCHITECTURES, "tiny", TINY_ARCH | dict(tie_embeddings=True))
  target, prompts, eos_ids = profile_round.load("random:tiny", jnp.bfloat16, "plain", 2, 12)
  assert target.cfg.name == "random-tiny" and eos_ids == ()
  assert [len(p) for p in prompts] == [12, 12]
  assert all(0 <= t < TINY_ARCH["vocab_size"] for p in prompts for t in p)
  assert {x.dtype for x in jax.tree.leaves(target.params)} == {jnp.dtype(jnp.bfloat16)}
  # A tied head is its own [D, V] copy, as the decoding programs load real targets.
  assert not target.cfg.tie_embeddings and target.params["lm_head"].shape == (32, 64)
  drafter = testing.drafter_for("pspec", target, num_draft=2)
  cfg = decode.DecodeConfig(max_new_tokens=9, num_draft=2, tree="chain")

  ms, rounds = measure.phase_split(target, drafter, prompts, cfg)
  assert set(ms) == {"draft", "verify", "accept+commit"} and min(ms.values()) > 0
  assert 2 <= rounds <= 16  # 8 tokens after the first for each prompt, 1 to 3 a round
  per_round, loop_rounds = measure.round_seconds(target, drafter, prompts[0], cfg)
  assert math.isfinite(per_round) and 1 <= loop_rounds <= 8  # its sign is the machine's
  with pytest.raises(ValueError, match="max_new_tokens >= 2, got 1"):
    measure.round_seconds(target, drafter, prompts[0], decode.DecodeConfig(max_new_tokens=1))

  step = measure.step_profile(target, prompts[0], cfg, steps=4, turns=3)
  params = target.params
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embedding"].nbytes
  assert step["weight_bytes"] == weight_bytes
  assert step["bandwidth_floor_ms"] > 0 and math.isfinite(step["step_over_floor"])


def test_read_ahead_budgets_are_timed_in_turns_and_the_kernel_s_is_restored(monkeypatch):
  monkeypatch.setitem(presets.ARCHITECTURES, "tiny", TINY_ARCH)
  target, prompts, _ = profile_round.load("random:tiny", jnp.float32, "decode", 2, 12)
  drafter = testing.drafter_for("pspec", target, num_draft=2)
  cfg = decode.DecodeConfig(max_new_tokens=5, num_draft=2, tree="chain")
  assert cpu_kernel.available(), cpu_kernel.describe()
  before = cpu_kernel.read_ahead()
  costs = profile_round.read_ahead_costs(
    target, {"none": None, "pspec": drafter}, prompts, cfg, [0, 65536], turns=2
  )
  assert list(costs) == ["none", "pspec"] and all(list(c) == [0, 65536] for c in costs.values())
  assert all(
    len(ms) == 2 and all(math.isfinite(t) for t in ms) for c in costs.values() for ms in c.values()
  )
  assert cpu_kernel.read_ahead() == before


def test_the_step_and_the_floor_are_timed_in_the_same_turns(monkeypatch):
  """Each turn's step (its 65-token decode less its 1-token one, over 4 rounds) against that
  turn's floor; the ratio is the median of the turns' ratios, which machine drift between turns
  leaves alone (here the ratio of the medians would be twice it)."""
  step_floor_ms = [(15, 10), (30, 20), (45, 30), (16, 10), (30, 10)]

  class FakeMethod:
    def __init__(self, target, drafter, cfg, seed):
      assert drafter is None and cfg.eos_ids == ()
      self.max_new_tokens = cfg.max_new_tokens

    def __call__(self, prompts, key):
      return types.SimpleNamespace(rounds=[4])

  def script(method_tokens):
    if method_tokens == 65:
      return iter([0] + [0.1 + 4 * s / 1e3 for s, _ in step_floor_ms])
    if method_tokens == 1:
      return iter([0] + [0.1] * len(step_floor_ms))
    return iter([0] + [f / 1e3 for _, f in step_floor_ms])

  def read():
    pass

  # The weights (all but an untied embedding) are 1 MB; the reader reads 2 MB: half its time.
  target = types.SimpleNamespace(
    params={"embedding": jnp.zeros(4), "w": jnp.zeros(1 << 18)},
    cfg=types.SimpleNamespace(tie_embeddings=False),
  )
  monkeypatch.setattr(measure, "OurMethod", FakeMethod)
  monkeypatch.setattr(measure, "_readers", lambda num_bytes: ({"sum": (read,)}, 2 << 20))
  durations = {65: script(65), 1: script(1), None: script(None)}
  monkeypatch.setattr(
    measure,
    "timed",
    lambda fn, *args: (None, next(durations[getattr(fn, "max_new_tokens", None)])),
  )
  cfg = decode.DecodeConfig(max_new_tokens=9, eos_ids=(7,))
  step = measure.step_profile(target, [1, 2], cfg, steps=64, turns=len(step_floor_ms))
  assert step["weight_bytes"] == 1 << 20
  assert step["decode_step_ms"] == pytest.approx(30)
  assert step["bandwidth_floor_ms"] == pytest.approx(10 / 2)
  assert step["step_over_floor"] == pytest.approx(1.5 * 2)


def test_round_seconds_takes_each_decodes_fastest_run(monkeypatch):
  # Each timed decode advances a fake clock by its next duration (the two compiling calls
  # first take none); the 4-token decode takes 3 rounds.
  durations = {4: iter([0, 0.9, 0.5, 0.7]), 1: iter([0, 0.2, 0.4, 0.1])}
  clock = [0.0]

  class FakeMethod:
    def __init__(self, target, drafter, cfg, seed):
      assert cfg.eos_ids == ()  # every run decodes all its tokens
      self.max_new_tokens = cfg.max_new_tokens

    def __call__(self, prompts, key):
      clock[0] += next(durations[self.max_new_tokens])
      return types.SimpleNamespace(rounds=[3])

  monkeypatch.setattr(measure, "OurMethod", FakeMethod)
  monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  cfg = decode.DecodeConfig(max_new_tokens=4, eos_ids=(7,))
  per_round, rounds = measure.round_seconds(None, None, [1, 2], cfg, repeats=3)
  assert rounds == 3 and per_round == pytest.approx((0.5 - 0.1) / 3)


def test_read_bandwidth_counts_bytes_read_once(monkeypatch):
  # A clock that ticks one second a reading: every read takes one second.
  ticks = iter(range(1000))
  monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
  assert measure.read_bandwidth(1 << 29, repeats=3) == 1 << 29
  assert measure.read_bandwidth(4 << 20, repeats=3) == 1 << 28  # never a buffer a cache holds
  # Whole [1024, 64] float32 panels for the kernel's read: the bytes actually read count.
  assert measure.read_bandwidth((1 << 28) + 1000, repeats=3) == 1 << 28


def test_read_bandwidth_takes_the_faster_reader(monkeypatch):
  # XLA's sum (one argument) reads in 1 s, the kernel's one-row product (three) in 0.5 s.
  assert cpu_kernel.available(), cpu_kernel.describe()
  monkeypatch.setattr(measure, "timed", lambda fn, *args: (None, 1.0 if len(args) == 1 else 0.5))
  assert measure.read_bandwidth(1 << 28, repeats=3) == 2 * (1 << 28)
  with cpu_kernel.disabled():
    assert measure.read_bandwidth(1 << 28, repeats=3) == 1 << 28
