"""The benchmark's report: report.md's tables and the plots, from `infer.bench`'s results.

`results` is what `infer.bench` writes to results.json: `meta` (the machine, the target, the
drafters, the config, what was left out) and `rows` (one per setting, `infer.measure`'s rows).
"""

import os

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from infer import measure


def _label(r: dict, varied: set[str]) -> str:
  label = r["method"]
  if r["method"] not in ("none", *measure.HF_METHODS):
    extra = [
      f"K={r['num_draft']}" if "num_draft" in varied else "",
      r["tree"] if "tree" in varied else "",
      r.get("drafts", "") if "drafts" in varied else "",
    ]
    extra = [e for e in extra if e]
    if extra:
      label += f" ({', '.join(extra)})"
  return label


def _varied(rows: list[dict]) -> set[str]:
  """The setting fields that take several values among the drafted rows."""
  keys = ("num_draft", "tree", "drafts")
  return {k for k in keys if len({r.get(k, "") for r in rows if r["num_draft"]}) > 1}


def _fmt(x, spec, suffix=""):
  return "" if x is None else f"{x:{spec}}{suffix}"


def machine(meta: dict) -> str:
  """The device the benchmark ran on, in a few words: the accelerator's kind, or the CPU."""
  kind = meta.get("device_kind", "cpu")
  if meta.get("platform", "cpu") != "cpu":
    return f"{kind} ({meta['platform'].upper()})"
  return f"CPU {meta['processor']}, {meta['cpu_count']} cores"


def report(results: dict) -> str:
  meta, rows = results["meta"], results["rows"]
  varied = _varied(rows)
  datasets = list(dict.fromkeys(r["dataset"] for r in rows))
  lines = [
    f"# Decoding benchmark: {meta['target']}",
    "",
    f"Machine: {meta['machine']}, {meta['processor']}, {meta['cpu_count']} CPUs; devices "
    f"{', '.join(meta['devices'])}; jax {meta['jax_version']}.",
    f"Prompts per dataset: {meta['config']['num_prompts']}, max_new_tokens "
    f"{meta['config']['max_new_tokens']}. Speedup is tokens/s over `none` in the same run; "
    "tau is tokens per target pass.",
  ]
  for d in meta["drafters"].values():
    if d["source"]:
      lines.append(
        f"Drafter {d['kind']}: {d['source']}, K={d['num_draft']}, tree {d['tree']} "
        f"(sampling: {d.get('sampling_tree') or d['tree']}), "
        f"trained {d['trained_steps']} steps."
      )
  for temperature in dict.fromkeys(r["temperature"] for r in rows):
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
      part = [r for r in rows if r["temperature"] == temperature and r["batch_size"] == batch]
      if not part:
        continue
      lines += [
        "",
        f"## Speedup / tau, temperature {temperature}, batch size {batch}",
        "",
        "| method | " + " | ".join(datasets) + " |",
        "|---|" + "---|" * len(datasets),
      ]
      for label in dict.fromkeys(_label(r, varied) for r in part):
        cells = []
        for dataset in datasets:
          hit = [r for r in part if r["dataset"] == dataset and _label(r, varied) == label]
          cells.append(
            ""
            if not hit
            else f"{_fmt(hit[0]['speedup'], '.2f', 'x')} / {_fmt(hit[0]['tau'], '.2f')}".strip(" /")
          )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
  if "num_draft" in varied:
    lines += [
      "",
      "## K ablation",
      "",
      "| method | K | tree | dataset | T | batch | speedup | tau |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(
      (r for r in rows if r["num_draft"]), key=lambda r: (r["method"], r["tree"], r["num_draft"])
    ):
      lines.append(
        f"| {r['method']} | {r['num_draft']} | {r['tree']} | {r['dataset']} | "
        f"{r['temperature']} | {r['batch_size']} | {_fmt(r['speedup'], '.2f', 'x')} | "
        f"{_fmt(r['tau'], '.2f')} |"
      )
  lines += [
    "",
    "## Every setting",
    "",
    "| method | dataset | T | batch | K | tree | drafts | tokens/s | speedup | tau "
    "| accept per depth | draft / verify / commit | lossless |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    accept = " ".join(f"{a:.2f}" for a in r["accept_per_depth"] or [])
    split = ""
    if r["draft_share"] is not None:
      split = " / ".join(
        f"{100 * r[k]:.0f}%" for k in ("draft_share", "verify_share", "commit_share")
      )
    lines.append(
      f"| {r['method']} | {r['dataset']} | {r['temperature']} | {r['batch_size']} | "
      f"{r['num_draft'] or ''} | {r['tree']} | {r.get('drafts', '')} | {r['tokens_per_s']:.1f} | "
      f"{_fmt(r['speedup'], '.2f', 'x')} | {_fmt(r['tau'], '.2f')} | {accept} | {split} | "
      f"{'' if r['lossless'] is None else r['lossless']} |"
    )
  lines += _chosen_table(rows)
  if meta["skipped"]:
    lines += ["", "Left out: " + "; ".join(meta["skipped"]) + "."]
  if "decode_step_ms" in meta:
    lines += [
      "",
      f"`none` decode step {meta['decode_step_ms']:.1f} ms; memory-bandwidth floor "
      f"{meta['bandwidth_floor_ms']:.1f} ms ({meta['weight_bytes'] / 1e6:.0f} MB of weights / "
      f"measured read bandwidth); step / floor {meta['step_over_floor']:.2f}, the median of "
      "each timing turn's own ratio (the two times are medians over the turns apart).",
    ]
  return "\n".join(lines) + "\n"


def _chosen_table(rows: list[dict]) -> list[str]:
  """How often an adaptive tree verified each of its candidates' trees, per setting (share of
  rounds; a candidate that left its lookup chain out counts as its drafted tree alone)."""
  adaptive = [r for r in rows if r.get("chosen")]
  if not adaptive:
    return []
  lines = [
    "",
    "## Adaptive trees: share of rounds per tree verified",
    "",
    "| method | dataset | T | batch | tree: share of rounds |",
    "|---|---|---|---|---|",
  ]
  for r in adaptive:
    total = max(sum(r["chosen"].values()), 1)
    shares = ", ".join(
      f"{'root alone' if name == 'paths:' else name}: {100 * n / total:.0f}%"
      for name, n in r["chosen"].items()
    )
    lines.append(
      f"| {r['method']} | {r['dataset']} | {r['temperature']} | {r['batch_size']} | {shares} |"
    )
  return lines


def _title(what: str, meta: dict, rows: list[dict]) -> str:
  """A plot's title: what it shows, the target, the machine, the datasets, T and batch size."""
  datasets = ", ".join(dict.fromkeys(r["dataset"] for r in rows))
  r = rows[0]
  return (
    f"{what}\n{meta['target']} on {machine(meta)}\n"
    f"{datasets}; temperature {r['temperature']:g}, batch size {r['batch_size']}"
  )


def _save(fig: Figure, out: str, name: str) -> str:
  fig.savefig(os.path.join(out, name), dpi=120)
  return name


def plots(results: dict, out: str) -> list[str]:
  """speedup.png, tau.png and (when K varies) k_ablation.png in `out`, for the first
  temperature and batch size of the results; returns their names."""
  meta, rows = results["meta"], results["rows"]
  varied = _varied(rows)
  first = [
    r
    for r in rows
    if (r["temperature"], r["batch_size"]) == (rows[0]["temperature"], rows[0]["batch_size"])
  ]
  datasets = list(dict.fromkeys(r["dataset"] for r in first))
  labels = list(dict.fromkeys(_label(r, varied) for r in first))
  written = []

  # Horizontal bars, a group per setting and a bar per dataset: long labels never meet.
  fig = Figure(figsize=(8, 2 + 0.3 * len(labels) * len(datasets)), layout="constrained")
  ax = fig.subplots()
  height = 0.8 / len(datasets)
  ys = np.arange(len(labels))[::-1]  # the first setting on top
  for i, dataset in enumerate(datasets):
    values = []
    for label in labels:
      hit = [r for r in first if r["dataset"] == dataset and _label(r, varied) == label]
      values.append(hit[0]["speedup"] or 0 if hit else 0)
    ax.barh(ys + 0.4 - (i + 0.5) * height, values, height, label=dataset)
  ax.axvline(1.0, color="gray", lw=0.8)
  ax.set_yticks(ys, labels)
  ax.set_xlabel("speedup over none (x, ratio of tokens/s)")
  ax.set_title(_title("Speedup over plain decoding", meta, first), fontsize=10)
  ax.legend(title="dataset", loc="lower right")
  ax.grid(axis="x", alpha=0.3)
  written.append(_save(fig, out, "speedup.png"))

  drafted = [r for r in first if r["tau_per_prompt"] and r["method"] not in ("none", "hf")]
  if drafted:
    # One horizontal box per setting, its label on a line of its own: long labels never meet.
    fig = Figure(figsize=(8, 2 + 0.4 * len(drafted)), layout="constrained")
    ax = fig.subplots()
    ax.boxplot(
      [r["tau_per_prompt"] for r in drafted[::-1]],
      orientation="horizontal",
      tick_labels=[f"{_label(r, varied)}, {r['dataset']}" for r in drafted[::-1]],
    )
    ax.set_xlabel("tau per prompt (tokens per target pass)")
    ax.set_title(_title("Tokens per target pass", meta, first), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    written.append(_save(fig, out, "tau.png"))

  if "num_draft" in varied:
    fig = Figure(figsize=(11, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for key in dict.fromkeys(
      (r["method"], r["tree"], r["dataset"]) for r in first if r["num_draft"]
    ):
      line = sorted(
        (r for r in first if (r["method"], r["tree"], r["dataset"]) == key),
        key=lambda r: r["num_draft"],
      )
      ks = [r["num_draft"] for r in line]
      left.plot(ks, [r["speedup"] or 0 for r in line], marker="o", label=" ".join(key))
      right.plot(ks, [r["tau"] or 0 for r in line], marker="o", label=" ".join(key))
    for ax in (left, right):
      ax.set_xlabel("K (draft tokens per round)")
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylabel("speedup over none (x, ratio of tokens/s)")
    right.set_ylabel("tau (tokens per target pass)")
    left.legend(fontsize=7)
    fig.suptitle(_title("K ablation", meta, first), fontsize=10)
    written.append(_save(fig, out, "k_ablation.png"))
  return written
