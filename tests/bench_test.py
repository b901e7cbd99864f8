"""`python -m infer.bench`: settings, rows, the report and plots, and one real run."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from infer import bench, measure, report
from pspec_jax import cpu_kernel, decode, drafter_files, testing, tree_specs
from pspec_jax import prompts as prompts_lib
from pspec_jax import tree as tree_lib
from pspec_jax.sampling import SamplingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {
  "method",
  "dataset",
  "temperature",
  "batch_size",
  "num_draft",
  "tree",
  "tokens_per_s",
  "speedup",
  "tau",
  "accept_per_depth",
  "draft_share",
  "verify_share",
  "lossless",
  "num_prompts",
  "tokens",
}


def config(**overrides):
  from configs import bench_default

  c = bench_default.get_config()
  c.update(overrides)
  return c


def test_settings_cover_every_combination_and_say_what_was_left_out():
  target = testing.make_target(1.0)
  drafters = {k: testing.drafter_for(k, target, num_draft=3) for k in ("pld", "pspec")}
  c = config(
    methods="pspec,hf,pld",
    datasets="mt_bench,humaneval",
    temperature="0,1",
    batch_size="1,2",
    num_draft="2,4",
    tree="chain",
  )
  settings, skipped = bench.settings_of(c, target, drafters)
  # none always runs first (it is every row's baseline); hf only at batch size 1.
  assert settings[0] == measure.Setting("none", "mt_bench", 0.0, 1, 0, "")
  by_method = {m: [s for s in settings if s.method == m] for m in ("none", "hf", "pld", "pspec")}
  assert len(by_method["none"]) == 2 * 2 * 2
  assert {s.batch_size for s in by_method["hf"]} == {1} and len(by_method["hf"]) == 4
  assert {s.num_draft for s in by_method["pld"]} == {2, 4} and len(by_method["pld"]) == 16
  # The pspec drafter proposes K=3 tokens at most: K=4 is left out, with the reason.
  assert {s.num_draft for s in by_method["pspec"]} == {2}
  assert any(
    s.startswith("pspec K=4 tree chain: the pspec drafter proposes at most K=3") for s in skipped
  )
  assert any(s.startswith("hf at batch size 2") for s in skipped)


def test_a_k_that_a_tree_of_fixed_depth_ignores_is_left_out_with_the_reason():
  """Before, the row said K=2 while the rank paths decoded exactly as with the drafter's K."""
  target = testing.make_target(1.0)
  drafters = {"pspec": testing.drafter_for("pspec", target, num_draft=3)}
  c = config(methods="pspec", num_draft="2,3", tree="paths:0/1,chain")
  settings, skipped = bench.settings_of(c, target, drafters)
  pspec = {(s.num_draft, s.tree) for s in settings if s.method == "pspec"}
  assert pspec == {(3, "paths:0/1"), (2, "chain"), (3, "chain")}
  assert "pspec K=2 tree paths:0/1: the tree fixes its own depth" in skipped


def test_each_drafter_decodes_with_its_own_tree_per_temperature():
  target = testing.make_target(1.0)
  pspec = testing.drafter_for("pspec", target, num_draft=3)
  pspec = pspec.replace(cfg=pspec.cfg.replace(tree="paths:0", sampling_tree="chain"))
  settings, _ = bench.settings_of(
    config(methods="pspec", temperature="0,1"), target, {"pspec": pspec}
  )
  trees = {s.temperature: s.tree for s in settings if s.method == "pspec"}
  assert trees == {0.0: "paths:0", 1.0: "chain"}
  for s in settings:  # each decodes at its own temperature, with its own tree
    cfg = s.decode_config(max_new_tokens=4, eos_ids=(), pad_id=0)
    assert cfg.sampling.temperature == s.temperature and cfg.tree == s.tree
  # A --config.tree given applies at every temperature.
  settings, _ = bench.settings_of(
    config(methods="pspec", temperature="0,1", tree="sparse4"), target, {"pspec": pspec}
  )
  assert {s.tree for s in settings if s.method == "pspec"} == {"sparse4"}


def test_both_acceptance_rules_in_one_run_where_the_rule_matters():
  target = testing.make_target(1.0)
  drafters = {k: testing.drafter_for(k, target, num_draft=3) for k in ("pld", "pspec")}
  c = config(methods="pld,pspec", temperature="0,1", tree="chain", drafts="sampled,top_k")
  settings, _ = bench.settings_of(c, target, drafters)
  rules = {(s.method, s.temperature): set() for s in settings}
  for s in settings:
    rules[(s.method, s.temperature)].add(s.drafts)
  # Only pspec sampling draws from q; greedy decoding and pld have one rule ("").
  assert rules == {
    ("none", 0.0): {""},
    ("none", 1.0): {""},
    ("pld", 0.0): {""},
    ("pld", 1.0): {""},
    ("pspec", 0.0): {""},
    ("pspec", 1.0): {"sampled", "top_k"},
  }
  for s in settings:
    cfg = s.decode_config(max_new_tokens=4, eos_ids=(), pad_id=0)
    assert cfg.drafts == (s.drafts or "sampled")
  with pytest.raises(ValueError, match="unknown drafts 'q'"):
    bench.settings_of(config(drafts="q"), target, drafters)


BAD_SETTINGS = [
  (dict(methods="none,magic"), "unknown methods ['magic']"),
  (dict(methods="bogus"), "unknown methods ['bogus']"),
  (dict(datasets="bogus"), "unknown dataset 'bogus'"),
  (dict(temperature="-1"), "temperatures must be >= 0"),
  (dict(batch_size="two"), "expected comma-separated ints"),
  (dict(tree="bushy"), "unknown tree 'bushy'"),
  (dict(num_prompts=0), "num_prompts, max_new_tokens and turns must be >= 1"),
  (dict(turns=0), "num_prompts, max_new_tokens and turns must be >= 1"),
  (dict(drafts="q"), "unknown drafts 'q'"),
]


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS)
def test_bad_settings_are_one_clear_error(overrides, message):
  target = testing.make_target(1.0)
  with pytest.raises(ValueError, match=re.escape(message)):
    bench.settings_of(config(**overrides), target, {})


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS)
def test_the_dry_run_rejects_what_the_run_rejects(overrides, message):
  """Before, `--dry_run --config.methods=bogus` planned `none` alone and exited 0."""
  with pytest.raises(ValueError, match=re.escape(message)):
    bench.dry_run(config(**overrides))


def test_rows_pool_tau_and_check_losslessness_only_when_greedy():
  base = measure.Setting("none", "mt_bench", 0.0, 2, 0, "")
  spec = measure.Setting("pspec", "mt_bench", 0.0, 2, 3, "chain")
  hot = measure.Setting("pspec", "mt_bench", 1.0, 2, 3, "chain")
  hot_base = hot.baseline
  plain = measure.Outcome(tokens=[[1, 2, 3, 4], [5, 6]], rounds=[3, 1], accepted=[[0] * 3] * 2)
  drafted = measure.Outcome(tokens=[[1, 2, 3, 4], [5, 6]], rounds=[1, 1], accepted=[[1, 1, 0]] * 2)
  wrong = measure.Outcome(tokens=[[1, 2, 3, 9], [5, 6]], rounds=[1, 1], accepted=[[1, 1, 0]] * 2)
  records = {base: [(2.0, plain)], spec: [(1.0, drafted)], hot_base: [(2.0, plain)]}
  records[hot] = [(1.0, wrong)]
  row = measure._row(spec, records, dict(draft=0.2, verify=0.7, **{"accept+commit": 0.1}))
  assert set(row) >= ROW_KEYS
  assert row["speedup"] == pytest.approx(2.0) and row["tokens"] == 6
  assert row["tau"] == pytest.approx((3 + 1) / 2) and row["tau_per_prompt"] == [3.0, 1.0]
  assert row["accept_per_depth"] == [1.0, 1.0, 0.0]
  assert row["lossless"] is True and row["draft_share"] == 0.2
  assert measure._row(base, records, None)["tau"] == 1.0
  sampled = measure._row(hot, records, None)
  assert sampled["lossless"] is None and sampled["speedup"] == pytest.approx(2.0)
  records[spec] = [(1.0, wrong)]
  assert measure._row(spec, records, None)["lossless"] is False
  # HF's float32 model against a target decoding from GGUF blocks (8-bit activations): no check.
  hf = measure.Setting("hf", "mt_bench", 0.0, 2, 0, "")
  records[hf] = [(2.0, wrong)]
  assert measure._row(hf, records, None, same_model=False)["lossless"] is None
  assert measure._row(hf, records, None)["lossless"] is False


def test_each_prompt_takes_turns_in_both_orders_and_is_timed_by_its_median(monkeypatch):
  """Three turns of two settings on two prompts: every setting decodes each prompt three times,
  the first turn in the family's order, the second reversed; a prompt's time is its median, so
  one slow decode (a hiccup on the machine) moves nothing."""
  base = measure.Setting("none", "mt_bench", 0.0, 1, 0, "")
  spec = measure.Setting("pspec", "mt_bench", 0.0, 1, 3, "chain")
  calls, warm = [], set()
  usual = {"none": 1.0, "pspec": 2.0}  # seconds a decode of one prompt takes
  slow = {("none", 1, 1), ("pspec", 0, 2)}  # (method, prompt, turn) hit by a hiccup: 9 s

  def runner(method):
    def run(batch, key):
      prompt = batch[0][0]
      if method in warm:  # the first call compiles and warms up, untimed
        calls.append((method, prompt))
      warm.add(method)
      return measure.Outcome([[prompt] * 3])

    return run

  def timed(fn, *args):
    out = fn(*args)
    method, prompt = calls[-1]
    turn = calls.count(calls[-1]) - 1
    return out, 9.0 if (method, prompt, turn) in slow else usual[method]

  monkeypatch.setattr(measure, "timed", timed)
  runners = {base: runner("none"), spec: runner("pspec")}
  prompts = {"mt_bench": [[0], [1]]}
  rows = measure.measure([base, spec], runners, prompts, seed=0, progress=False, turns=3)
  order = [("none", 0), ("pspec", 0), ("pspec", 0), ("none", 0), ("none", 0), ("pspec", 0)]
  assert calls == order + [(m, 1) for m, _ in order]
  assert [r["seconds"] for r in rows] == [2.0, 4.0]
  assert rows[1]["speedup"] == pytest.approx(0.5) and rows[0]["tokens"] == 6
  with pytest.raises(ValueError, match="turns must be at least 1, got 0"):
    measure.measure([base], runners, prompts, seed=0, progress=False, turns=0)


def test_rows_and_report_count_how_often_each_adaptive_candidate_was_chosen():
  target = testing.make_target(5.0)
  cfg = decode.DecodeConfig(max_new_tokens=12, tree="adaptive:paths:0|lookup:3")
  run = measure.OurMethod(target, testing.drafter_for("pspec", target), cfg, pad_id=0)
  outcomes = [run([[5, 9, 2, 13, 7], [1, 2]], jax.random.key(0)), run([[6]], jax.random.key(1))]
  assert list(outcomes[0].chosen) == ["paths:", "paths:0", "lookup:3"]
  spec = measure.Setting("pspec", "mt_bench", 0.0, 2, 4, cfg.tree)
  row = measure._row(spec, {spec: [(1.0, o) for o in outcomes]}, None)
  total = {k: outcomes[0].chosen[k] + outcomes[1].chosen[k] for k in outcomes[0].chosen}
  assert row["chosen"] == total
  assert sum(total.values()) == sum(max(o.rounds) for o in outcomes)
  assert (
    measure._row(spec.baseline, {spec.baseline: [(1.0, measure.Outcome([[1]]))]}, None)["chosen"]
    is None
  )
  row["chosen"] = {"paths:": 3, "paths:0": 1, "lookup:3": 0}
  lines = report._chosen_table([row])
  assert lines[-1] == "| pspec | mt_bench | 0.0 | 2 | root alone: 75%, paths:0: 25%, lookup:3: 0% |"


def test_adaptive_rounds_count_under_the_tree_they_verified():
  # A candidate's rounds without its lookup chain verified its drafted tree (or the root) alone.
  pool = tree_specs.parse("adaptive:paths:0|lookup:3|paths:0+lookup:3", 4)
  counts = measure.verified_trees(pool.candidates, [3, 4, 6, 5], [0, 0, 2, 1])
  assert counts == {"paths:": 3 + 4, "lookup:3": 2, "paths:0": 4 + 4, "paths:0+lookup:3": 1}


def test_report_and_plots_show_the_main_table_and_the_k_ablation(tmp_path):
  def row(method, k, speedup, tau):
    return dict(
      method=method,
      dataset="mt_bench",
      temperature=0.0,
      batch_size=1,
      num_draft=k,
      tree="chain" if k else "",
      tokens_per_s=10.0 * speedup,
      speedup=speedup,
      tau=tau,
      accept_per_depth=[0.5] * k,
      draft_share=0.1,
      verify_share=0.8,
      commit_share=0.1,
      lossless=True,
      num_prompts=2,
      tokens=20,
      seconds=1.0,
      tau_per_prompt=[tau, tau + 0.5],
    )

  rows = [row("none", 0, 1.0, 1.0)] + [row("pspec", k, 1 + k / 10, 1 + k / 3) for k in (1, 2, 3)]
  meta = dict(
    target="smollm2-135m-instruct",
    machine="test machine",
    processor="x86_64",
    cpu_count=2,
    devices=["cpu:0"],
    jax_version="0",
    drafters={"pspec": dict(kind="pspec", num_draft=4, tree="chain", source="d", trained_steps=9)},
    config=dict(num_prompts=2, max_new_tokens=8),
    skipped=["pspec K=5 tree chain: too deep"],
  )
  results = dict(meta=meta, rows=rows)
  text = report.report(results)
  assert "| pspec (K=3) | 1.30x / 2.00 |" in text
  assert "## K ablation" in text and "| pspec | 2 | chain | mt_bench |" in text
  assert "test machine" in text and "Left out: pspec K=5" in text
  written = report.plots(results, str(tmp_path))
  assert written == ["speedup.png", "tau.png", "k_ablation.png"]
  for name in written:
    assert (tmp_path / name).stat().st_size > 1000


def test_prompt_sets_ship_offline():
  assert len(prompts_lib.prompt_set("mt_bench")) == 80
  humaneval = prompts_lib.prompt_set("humaneval", 3)
  assert len(humaneval) == 3 and humaneval[0].startswith("from typing import List")
  sharegpt = prompts_lib.prompt_set("sharegpt", 5)
  assert len(sharegpt) == 5 and all(p.strip() for p in sharegpt)
  with pytest.raises(ValueError, match="unknown prompt set 'nope'"):
    prompts_lib.prompt_set("nope")


@pytest.mark.slow
def test_a_real_run_writes_results_report_and_plots(tmp_path, drafting_pays):
  """The embedded default with its shipped pspec drafter and HF generate, on held-out ShareGPT,
  greedy (sampling runs the same path; its rows are `test_rows_pool_tau...`'s). The pspec
  drafter's adaptive tree reads round costs from a calibration where drafting pays."""
  out = tmp_path / "bench"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "infer.bench",
      "--config=configs/bench_default.py:smoke",
      "--config.methods=none,pspec,hf",
      "--config.datasets=sharegpt",
      f"--config.out={out}",
    ],
    cwd=ROOT,
    env={**testing.cli_env(), **drafting_pays(batch=1)},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr
  assert "calibrating" not in result.stderr  # the costs were read from the file
  results = json.loads((out / "results.json").read_text())
  assert {"machine", "devices", "jax_version", "target", "drafters", "config"} <= set(
    results["meta"]
  )
  rows = {r["method"]: r for r in results["rows"]}
  assert list(rows) == ["none", "pspec", "hf"] and len(results["rows"]) == 3
  for r in rows.values():
    assert set(r) >= ROW_KEYS and r["dataset"] == "sharegpt" and r["num_prompts"] == 2
    assert r["temperature"] == 0 and r["tokens_per_s"] > 0 and r["speedup"] > 0
    assert 0 < r["tokens"] <= 2 * 8
  # The drafter's default on a CPU: its adaptive tree, whose rounds per candidate tree it reports.
  shipped = drafter_files.shipped_drafter("smollm2-135m-instruct", "pspec")
  shipped = json.loads((pathlib.Path(shipped) / drafter_files.CONFIG_FILE).read_text())
  assert shipped["device_trees"]["cpu"]["default_tree"] == "adaptive"
  assert rows["pspec"]["tree"] == "adaptive"
  chosen = rows["pspec"]["chosen"]
  assert (
    sum(chosen.values()) > 0
    and sum(n for t, n in chosen.items() if t != tree_lib.ROOT_ONLY.spec) > 0
  )
  assert rows["none"]["lossless"] is True and rows["pspec"]["lossless"] is True
  # HF runs the float32 model; with the kernel the target decodes from its GGUF blocks with
  # 8-bit activations, another model: no lossless check then.
  if cpu_kernel.available():
    assert rows["hf"]["lossless"] is None
  else:
    assert isinstance(rows["hf"]["lossless"], bool)
  candidates = shipped["device_trees"]["cpu"]["adaptive"]
  depth = tree_specs.parse(f"adaptive:{candidates}", rows["pspec"]["num_draft"]).max_depth
  assert rows["pspec"]["tau"] >= 1 and len(rows["pspec"]["accept_per_depth"]) == depth
  # An adaptive round runs as one step: no phase shares (a fixed tree's are `phase_shares`').
  assert all(rows["pspec"][k] is None for k in ("draft_share", "verify_share", "commit_share"))
  assert (out / "report.md").read_text().startswith("# Decoding benchmark")
  assert (out / "speedup.png").exists() and (out / "tau.png").exists()


@pytest.mark.parametrize("prompt_lookup", [False, True])
def test_hf_generate_samples_reproducibly_from_the_key(tmp_path, prompt_lookup):
  testing.save_hf_llama(tmp_path, **testing.HF_CONFIGS["gqa_untied"])
  cfg = decode.DecodeConfig(
    max_new_tokens=12, sampling=SamplingConfig(temperature=1.0), eos_ids=(95,)
  )
  hf = measure.HFMethod(str(tmp_path), cfg, threads=1, prompt_lookup=prompt_lookup)
  prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
  draws = [hf(prompt, jax.random.key(seed)).tokens[0] for seed in (0, 0, 1, 2)]
  assert draws[0] == draws[1] and 1 <= len(draws[0]) <= 12
  assert draws[0] != draws[2] or draws[0] != draws[3]  # a random 96-token model: not greedy
  # Without EOS (a sampled bench row), every draw is max_new_tokens long, as pspec_jax's are.
  cfg = dataclasses.replace(cfg, eos_ids=())
  hf = measure.HFMethod(str(tmp_path), cfg, threads=1, prompt_lookup=prompt_lookup)
  assert [len(hf(prompt, jax.random.key(seed)).tokens[0]) for seed in range(4)] == [12] * 4


def test_sampled_rows_decode_past_eos_to_their_length_unless_asked_to_stop():
  """A sampled answer's length is a random draw, another for each method; each row's tokens
  per second would weigh its prefill differently. Greedy rows stop at EOS."""
  greedy = measure.Setting("pspec", "mt_bench", 0.0, 1, 3, "chain")
  sampled = dataclasses.replace(greedy, temperature=1.0)
  given = dict(max_new_tokens=4, eos_ids=(2, 5), pad_id=0)
  assert greedy.decode_config(**given).eos_ids == (2, 5)
  assert sampled.decode_config(**given).eos_ids == ()
  assert sampled.decode_config(**given, sampled_eos=True).eos_ids == (2, 5)
  assert config().sampled_eos is False


LLAMA2_13B_CONFIG = dict(
  architectures=["LlamaForCausalLM"],
  model_type="llama",
  vocab_size=32000,
  hidden_size=5120,
  intermediate_size=13824,
  num_hidden_layers=40,
  num_attention_heads=40,
  num_key_value_heads=40,
  max_position_embeddings=4096,
  rms_norm_eps=1e-5,
  rope_theta=10000.0,
  tie_word_embeddings=False,
)


@pytest.mark.parametrize(
  "hardware,mesh,verdict,params_gib",
  [
    ("v4-32", "data=4,tensor=4", "fits in 32 GiB", 24.2 / 4),
    ("gpu-80gb", "", "fits in 80 GiB", 24.2),
    ("v5e-16", "data=16", "does NOT fit in 16 GiB", 24.2),
  ],
)
def test_dry_run_plans_a_13b_target_without_its_weights(
  tmp_path, hardware, mesh, verdict, params_gib
):
  """Only config.json is there: the plan needs shapes, never weights."""
  (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B_CONFIG))
  c = config(
    target=str(tmp_path),
    dtype="bfloat16",
    hardware=hardware,
    mesh=mesh,
    methods="none,pspec",
    batch_size="1,8",
    tree="chain,sparse16",
  )
  text = bench.dry_run(c)
  assert "13.016B parameters in bfloat16" in text
  assert "batch 8" in text and "trees of 16 nodes" in text
  *table, compiled = text.splitlines()
  rows = dict(line.rsplit(None, 1) for line in table[3:-1])
  assert float(rows["target params"]) == pytest.approx(params_gib, rel=0.01)
  assert {"drafter params (pspec)", "target KV cache", "drafter KV cache (pspec)"} <= set(rows)
  assert table[-1].endswith(verdict)
  # These 8 CPU devices are not the plan's hardware: nothing is compiled for it.
  devices = {"v4-32": 16, "gpu-80gb": 1, "v5e-16": 16}[hardware]
  platform = "gpu" if hardware.startswith("gpu") else "tpu"
  assert compiled == (
    f"compiled memory analysis: not run here (8 cpu device(s), the plan is for {devices} "
    f"{platform}); run --dry_run on that hardware"
  )


def test_dry_run_on_its_hardware_compiles_sharded_decoding(tmp_path, monkeypatch):
  """Where the host has the plan's devices, decode.generate is compiled for the mesh on
  abstract arguments and XLA's memory analysis is reported per method."""
  from infer import plan
  from pspec_jax import drafter as drafter_lib
  from pspec_jax import llama, sharding

  target = testing.TINY.replace(scan_layers=False)
  pspec = drafter_lib.DrafterConfig.for_target("pspec", target, num_draft=4)
  mesh = sharding.make_mesh(data=2, tensor=4)

  def compiled(drafter, batch, max_new_tokens):
    return plan.compiled_decode_bytes(
      target,
      drafter,
      batch=batch,
      prompt_width=16,
      max_new_tokens=max_new_tokens,
      tree="sparse4",
      mesh=mesh,
    )

  none, small, large = compiled(None, 2, 8), compiled(pspec, 2, 8), compiled(pspec, 8, 64)
  exact = lambda init_params, init_boxed, cfg: sharding.bytes_per_device(
    jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))),
    sharding.param_shardings(init_boxed, cfg, mesh),
  )
  target_bytes = exact(llama.init_params, llama.init_boxed, target)
  assert none["parameters held"] == target_bytes
  assert small["parameters held"] == target_bytes + exact(
    drafter_lib.init_params, drafter_lib.init_boxed, pspec
  )
  # The caches are made inside the program: they grow with batch and length.
  assert 0 < none["temporaries (caches included)"] < small["temporaries (caches included)"]
  assert small["temporaries (caches included)"] < large["temporaries (caches included)"]

  # The table, on a host whose devices are the preset's (8 CPU devices here).
  monkeypatch.setitem(plan.HARDWARE, "cpu", (8, 24.0))
  (tmp_path / "config.json").write_text(
    json.dumps(
      dict(
        LLAMA2_13B_CONFIG,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
      )
    )
  )
  c = config(target=str(tmp_path), hardware="cpu", mesh="data=2,tensor=4", methods="none,pspec")
  lines = bench.dry_run(c).splitlines()
  at = lines.index("compiled decoding on 8 cpu device(s), per device, GiB")
  assert [line.split()[0] for line in lines[at + 1 :]] == ["none", "pspec"]
  assert all(line.endswith("fits in 24 GiB") for line in lines[at + 1 :])
