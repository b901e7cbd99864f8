"""Round-cost calibration: once per device, target, dtype and batch; stored and read back."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer import calibration
from infer import measure as measure_lib
from pspec_jax import cpu_kernel, decode, llama, testing
from pspec_jax.sampling import SamplingConfig

TREE = "adaptive:paths:0|lookup:3"
PROMPT = [5, 9, 2, 13, 7]
WIDTH = 16  # the decode's prompt width
COMPILED = []  # the programs XLA compiled, by name


def _compiled(event, seconds, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration":
    COMPILED.append(kwargs.get("fun_name"))


jax.monitoring.register_event_duration_secs_listener(_compiled)


@pytest.fixture(scope="module")
def target():
  return testing.make_target(5.0)


@pytest.fixture
def fake_measure(monkeypatch):
  """calibration.measure counting its calls, with made-up times."""
  calls = []

  def measure(target, drafter, cfg, batch, ids, width, repeats=5, log=None):
    calls.append((target.cfg.name, batch, cfg.sampling))
    pool = decode.resolve_tree(cfg, drafter)
    return {
      c.spec: dict(
        costs=[1.0 + 0.1 * (c.num_nodes - 1), 1.0 + 0.1 * (c.num_nodes + c.lookup - 1)],
        round_ms=[10.0, 12.0],
        nodes=[c.num_nodes, c.num_nodes + c.lookup],
      )
      for c in pool.candidates
    }

  monkeypatch.setattr(calibration, "measure", measure)
  return calls


def costs(target, tmp_path, batch=1, logs=None, tree=TREE, kind="pspec", **decoding):
  log = (logs if logs is not None else []).append
  cfg = decode.DecodeConfig(tree=tree, **decoding)
  drafter = testing.drafter_for(kind, target)
  path = str(tmp_path / "costs.json")
  return calibration.costs_for(target, drafter, cfg, batch, PROMPT, WIDTH, path=path, log=log)


def test_costs_are_measured_once_stored_and_read_back(target, tmp_path, fake_measure):
  logs = []
  first = costs(target, tmp_path, logs=logs)
  assert first == ((1.0, 1.0), (1.1, 1.1), (1.0, 1.3)) and len(fake_measure) == 1
  assert any("| pspec lookup:3 | 1/4 | 1.000 | 1.300 |" in line for line in logs)  # explained
  stored = json.loads((tmp_path / "costs.json").read_text())
  (key,) = stored["machines"]
  assert key == f"cpu:{jax.devices()[0].device_kind}|tiny|float32|batch=1"
  assert set(stored["machines"][key]) == {"pspec paths:", "pspec paths:0", "pspec lookup:3"}
  assert costs(target, tmp_path) == first and len(fake_measure) == 1  # read back
  # Another drafter kind shares the file, under its own entries.
  costs(target, tmp_path, kind="medusa")
  assert len(fake_measure) == 2


def test_costs_are_measured_again_when_the_machine_key_changes(
  target, tmp_path, fake_measure, monkeypatch
):
  costs(target, tmp_path)
  costs(target, tmp_path, batch=4)  # batch
  other = testing.make_target(5.0, cfg=testing.TINY.replace(name="tiny-2"))
  costs(other, tmp_path)  # target
  bf16 = llama.Target(cfg=target.cfg.replace(dtype=jax.numpy.bfloat16), params=target.params)
  costs(bf16, tmp_path)  # dtype
  assert len(fake_measure) == 4
  device = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  cpu_devices = jax.devices
  monkeypatch.setattr(jax, "devices", lambda: [device])
  costs(target, tmp_path)  # device
  assert len(fake_measure) == 5
  machines = json.loads((tmp_path / "costs.json").read_text())["machines"]
  assert len(machines) == 5 and any(k.startswith("gpu:NVIDIA H100") for k in machines)
  monkeypatch.setattr(jax, "devices", cpu_devices)
  packed = target.with_weight_layout("panels")
  costs(packed, tmp_path)  # panel weights, through the CPU panel kernel
  with cpu_kernel.disabled():
    costs(packed, tmp_path)  # ... and through XLA
  assert len(fake_measure) == 7
  machines = json.loads((tmp_path / "costs.json").read_text())["machines"]
  assert sum("|panels: CPU kernels (" in k for k in machines) == 1
  assert sum("|panels: XLA" in k for k in machines) == 1
  if cpu_kernel.available():  # another build of the kernel (its source changed): measured again
    assert f" build {cpu_kernel.build_id()}" in next(k for k in machines if "CPU kernels" in k)
    monkeypatch.setattr(cpu_kernel, "build_id", lambda: "0123456789abcdef")
    costs(packed, tmp_path)
    assert len(fake_measure) == 8


def test_sampled_rounds_are_timed_apart_from_greedy_ones(target, tmp_path, fake_measure):
  """A sampled round costs more (filtering, draws from q): its costs are measured at its own
  sampling settings and stored under their own entries, per draft rule and filter."""
  costs(target, tmp_path)
  hot = SamplingConfig(temperature=1.0)
  costs(target, tmp_path, sampling=hot)
  costs(target, tmp_path, sampling=SamplingConfig(temperature=0.7))  # same rule: read back
  costs(target, tmp_path, sampling=hot, drafts="top_k")
  costs(target, tmp_path, sampling=SamplingConfig(temperature=1.0, top_p=0.9))
  assert [c[2] for c in fake_measure] == [
    SamplingConfig(),
    hot,
    hot,
    SamplingConfig(temperature=1.0, top_p=0.9),
  ]
  (entries,) = json.loads((tmp_path / "costs.json").read_text())["machines"].values()
  assert "pspec paths:0" in entries
  assert "pspec paths:0 [T>0 top_k=0 top_p=1, drafts from q]" in entries
  assert "pspec paths:0 [T>0 top_k=0 top_p=1, drafts top-k]" in entries
  assert "pspec paths:0 [T>0 top_k=0 top_p=0.9, drafts from q]" in entries
  # pld has no q: whatever the draft rule, its drafts are the lookup's.
  costs(target, tmp_path, kind="pld", tree="adaptive:lookup:2|lookup:4", sampling=hot)
  (entries,) = json.loads((tmp_path / "costs.json").read_text())["machines"].values()
  assert "pld lookup:2 [T>0 top_k=0 top_p=1, drafts top-k]" in entries


@pytest.mark.parametrize(
  ("content", "why"),
  [
    ("{not json", "is corrupt"),
    (
      f'{{"version": {calibration.VERSION}, "machines": {{"k": {{"c": {{"costs": [1.0]}}}}}}}}',
      "is corrupt",
    ),
    ('{"version": 1, "machines": {}}', f"is of version 1, not {calibration.VERSION}"),
    ("[]", "is corrupt"),
  ],
)
def test_a_corrupt_or_older_file_is_reported_and_measured_again(
  target, tmp_path, fake_measure, content, why
):
  (tmp_path / "costs.json").write_text(content)
  logs = []
  assert costs(target, tmp_path, logs=logs)[0] == (1.0, 1.0)
  assert any(f"calibration file {tmp_path / 'costs.json'} {why}" in x for x in logs)
  assert any("measuring again" in x for x in logs) and len(fake_measure) == 1
  assert calibration.load(str(tmp_path / "costs.json"))  # rewritten whole


def test_a_fixed_tree_needs_no_calibration(target, tmp_path, fake_measure):
  assert costs(target, tmp_path, tree="paths:0+lookup:3") == ()
  assert not fake_measure and not (tmp_path / "costs.json").exists()


def _scripted_turns(monkeypatch, turns):
  """`measure.interleaved_times` handing out `turns` in order: each a list, per turn, of
  (short, long) call times of options (0, False) and (1, False), and the feed's."""
  script = iter(turns)

  def interleaved_times(calls, repeats):
    batch = next(script)
    assert len(batch) == repeats
    times = {name: [] for name in calls}
    for (root, other), feed in batch:
      for (c, n), t in zip(
        [(0, calibration.SHORT_ROUNDS), (0, calibration.ROUNDS)]
        + [(1, calibration.SHORT_ROUNDS), (1, calibration.ROUNDS)],
        [*root, *other],
        strict=True,
      ):
        times[(c, False, n)].append(t)
      times["feed"].append(feed)
    return times

  monkeypatch.setattr(calibration.measure_lib, "interleaved_times", interleaved_times)
  calls = {
    (c, False, n): None for c in (0, 1) for n in (calibration.SHORT_ROUNDS, calibration.ROUNDS)
  }
  return calls | {"feed": None}


def test_rounds_that_come_out_below_zero_are_left_out_and_more_turns_timed(monkeypatch):
  span = calibration.ROUNDS - calibration.SHORT_ROUNDS
  good = ((20.0, 20.0 + 10 * span), (30.0, 30.0 + 15 * span)), 4.0  # rounds 10 and 15 ms
  noise = ((50.0, 40.0), (30.0, 30.0 + 15 * span)), 4.0  # the root's short call slowed
  calls = _scripted_turns(monkeypatch, [[good, noise, noise], [good, good, good]])
  per_round, feed = calibration._round_times(calls, [(0, False), (1, False)], 3, 1, print)
  nan = float("nan")
  np.testing.assert_allclose(per_round[(0, False)], [10.0, nan, nan, 10.0, 10.0, 10.0])
  np.testing.assert_allclose(per_round[(1, False)], [15.0] * 6)
  np.testing.assert_allclose(feed, [2.0] * 6)  # a feed per kept + 1 rounds
  # The option's cost: from the turns both were timed in.
  assert measure_lib.paired_ratio(per_round[(1, False)], per_round[(0, False)]) == 1.5


def test_rounds_that_stay_noise_come_from_the_fastest_calls_and_are_reported(monkeypatch):
  # In no turn are both rounds above zero: the root's is in one, the other option's in the other.
  one = ((50.0, 200.0), (30.0, 25.0)), 4.0
  other = ((250.0, 210.0), (30.0, 60.0)), 4.0
  calls = _scripted_turns(monkeypatch, [[one, other]] * calibration.ATTEMPTS)
  logs = []
  per_round, feed = calibration._round_times(calls, [(0, False), (1, False)], 2, 1, logs.append)
  turns = 2 * calibration.ATTEMPTS
  assert f"came out above zero in 0 of {turns} turns" in logs[0] and "fastest calls" in logs[0]
  # The root's fastest calls: 200 long, 50 short. The other's fastest long call (25) is shorter
  # than its fastest short one (30): its round is then the long call's, per round.
  span = calibration.ROUNDS - calibration.SHORT_ROUNDS
  np.testing.assert_allclose(per_round[(0, False)], [150.0 / span] * turns)
  np.testing.assert_allclose(per_round[(1, False)], [25.0 / calibration.ROUNDS] * turns)
  assert len(feed) == turns


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_measured_costs_are_relative_to_the_root_alone(target, temperature):
  """Greedy rounds, and sampled rounds with drafts drawn from q, timed for real, in the programs
  that decode: decoding at the width calibrated compiles nothing more."""
  cfg = decode.DecodeConfig(
    tree=TREE, max_new_tokens=12, sampling=SamplingConfig(temperature=temperature)
  )
  drafter = testing.drafter_for("pspec", target)
  pool = decode.resolve_tree(cfg, drafter)
  del COMPILED[:]
  measured = calibration.measure(target, drafter, cfg, 2, PROMPT, WIDTH, repeats=3)
  assert {"jit(_init)", "jit(run)"} <= set(COMPILED)
  assert list(measured) == [c.spec for c in pool.candidates]
  assert measured["paths:"]["costs"] == [1.0, 1.0]
  for entry in measured.values():
    assert all(c >= 1.0 for c in entry["costs"]) and all(t > 0 for t in entry["round_ms"])
  assert measured["lookup:3"]["nodes"] == [1, 4]
  assert measured["paths:0"]["nodes"] == [2, 2]
  del COMPILED[:]
  costs = tuple(tuple(entry["costs"]) for entry in measured.values())
  tokens, lengths = testing.padded(testing.PROMPTS[:2])
  tokens = np.pad(tokens, ((0, 0), (0, WIDTH - tokens.shape[1])))
  cfg = dataclasses.replace(cfg, costs=costs)
  out = decode.generate(target, tokens, lengths, jax.random.key(1), cfg, drafter)
  assert int(out.lengths.min()) == 12
  assert {"jit(_init)", "jit(run)"}.isdisjoint(COMPILED), COMPILED


def test_rounds_are_timed_when_the_prefill_ends_every_answer(target):
  """Every token an EOS: the prefill's token ends each answer, yet the context calibration
  times from is active and its rounds run (before, no round ran from such a context and noise
  was stored as the costs)."""
  drafter = testing.drafter_for("pspec", target).with_head(target)
  cfg = decode.DecodeConfig(
    tree=TREE, max_new_tokens=12, eos_ids=tuple(range(target.cfg.vocab_size))
  )
  plan = decode.make_plan(cfg, drafter, WIDTH)
  tokens, lengths = testing.padded(testing.PROMPTS[:2])
  tokens = np.pad(tokens, ((0, 0), (0, WIDTH - tokens.shape[1])))
  assert decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0)).done.all()
  start = calibration._start(plan, target, drafter, PROMPT, 2, WIDTH)
  assert not start.done.any()
  state = calibration._copy(start)  # `decode.run` takes its state
  out = decode.run(plan, target, drafter, state, start.step + 3, np.bool_(True))
  assert int(out.step) == int(start.step) + 3


@pytest.mark.parametrize("option", [(0, False), (1, False), (2, True)])
def test_option_rounds_run_their_candidate_from_the_same_context(target, option):
  """What calibration times: with the choice pinned to an option, a round verifies that
  candidate (with its chain, if the option has it: the context finds a match); restarted, every
  round starts from the same context, the option pinned."""
  drafter = testing.drafter_for("pspec", target).with_head(target)
  cfg = decode.DecodeConfig(tree=TREE, max_new_tokens=12)
  plan = decode.make_plan(cfg, drafter, 2 * len(PROMPT))
  choice, chain = option
  start = calibration._start(plan, target, drafter, PROMPT, 1, 2 * len(PROMPT))
  # `lookup:3` without its chain is the root alone: no round of its own to pin.
  with pytest.raises(ValueError, match="no adaptive round runs candidate 2 with chain=False"):
    calibration._pinned(start, 2, False, plan.tree)
  start = calibration._pinned(start, choice, chain, plan.tree)

  def run(rounds, restart):
    state = calibration._copy(start)  # `decode.run` takes its state
    return decode.run(plan, target, drafter, state, start.step + rounds, np.bool_(restart))

  once = run(1, False)  # the first round, as calibration times it
  assert int(once.step) == int(start.step) + 1
  assert once.adapt.chosen.tolist() == [int(c == choice) for c in range(3)]
  assert once.adapt.chained.tolist() == [int(c == choice and chain) for c in range(3)]
  found = jnp.any(once.adapt.lookup != start.adapt.lookup)  # the chain was verified
  assert bool(found) == chain
  # Restarted, every round is that round: each writes the same keys and values to the caches,
  # and leaves the rest of the state as it started (the step aside).
  thrice = run(3, True)
  assert int(thrice.step) == int(start.step) + 3
  for a, b in zip(jax.tree.leaves(thrice.cache), jax.tree.leaves(once.cache), strict=True):
    if a.ndim > 1:  # the buffers
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(thrice.cache.lengths, start.cache.lengths)
  for a, b in zip(
    jax.tree.leaves(thrice.replace(cache=None, drafter_cache=None, step=None)),
    jax.tree.leaves(start.replace(cache=None, drafter_cache=None, step=None)),
    strict=True,
  ):
    if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      np.testing.assert_array_equal(a, b)
  # Not restarted, the rounds go on from where each left off.
  assert int(run(3, False).cache.lengths[0]) > int(once.cache.lengths[0])


def test_a_cost_compares_rounds_timed_in_the_same_turn(target, monkeypatch):
  """The machine slows down in turn 3, between the root alone's time and the others': each
  turn's ratio is 1.2 (1.5 with the chain), where the ratio of medians would be 2.4. Every call
  also costs 40 ms besides its rounds, which cancels: over 10 rounds alone it would have made
  the ratios about 1.17 and 1.42."""
  root = [10.0, 10.0, 10.0, 20.0, 20.0]
  later = [10.0, 10.0, 20.0, 20.0, 20.0]

  def times(calls, repeats):
    assert repeats == 5
    out = {"feed": [0.0] * repeats}
    for name in calls:
      if name == "feed":
        continue
      c, chain, n = name
      per_round = root if (c, chain) == (0, False) else later
      scale = 1.5 if (c, chain) == (2, True) else 1.0 if (c, chain) == (0, False) else 1.2
      out[name] = [40.0 + n * scale * t for t in per_round]
    assert {name[2] for name in calls if name != "feed"} == {
      calibration.SHORT_ROUNDS,
      calibration.ROUNDS,
    }
    return out

  monkeypatch.setattr(calibration.measure_lib, "interleaved_times", times)
  drafter = testing.drafter_for("pspec", target)
  cfg = decode.DecodeConfig(tree=TREE)
  measured = calibration.measure(target, drafter, cfg, 1, PROMPT, WIDTH, repeats=5)
  assert measured["paths:"]["costs"] == [1.0, 1.0]
  np.testing.assert_allclose(measured["paths:0"]["costs"], [1.2, 1.2])
  # Without its chain, the chain alone is the root alone: the root's times, cost 1.
  np.testing.assert_allclose(measured["lookup:3"]["costs"], [1.0, 1.5])
  np.testing.assert_allclose(measured["lookup:3"]["round_ms"], [10.0, 30.0])  # medians
