r"""Speedup and acceptance length of every decoding method on real prompt sets, in one run.

  python -m infer.bench                                   # configs/bench_default.py
  python -m infer.bench --config.methods=none,pspec --config.datasets=mt_bench,humaneval
  python -m infer.bench --config=configs/bench_default.py:ablation   # K = 1..4, chain trees
  python -m infer.bench --config.temperature=0,1 --config.batch_size=1,4

Settings (method, dataset, temperature, batch size, K, tree) are run a family (same dataset,
temperature and batch size) at a time: every setting of the family is compiled and warmed up
first, then they are interleaved prompt batch by prompt batch, so machine noise hits all of them
alike; the family's compiled programs are dropped before the next. Per setting it records
tokens/s, the speedup over `none` measured in the same run, tau (tokens per target pass),
per-depth acceptance, the share of a round spent drafting, verifying and accepting +
committing (from a few prompts run phase by phase), at temperature 0 whether every output
equals `none`'s token for token (the lossless check), and for an adaptive tree how often each
candidate was chosen. An adaptive tree's round costs come from this machine's calibration
(`infer.calibration`, measured at the first run that needs them).

Methods: `none` (plain decoding), `pld`, `medusa`, `eagle`, `pspec` (pspec_jax.decode with the
shipped drafters or those under `drafter_dir`), and `hf` / `hf_pld` (HF transformers' PyTorch
`generate` on the same weights in the same dtype, plain and with prompt lookup, on a CUDA GPU
when JAX runs on one; batch size 1, and only when torch is installed).
"""

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

from absl import flags
from ml_collections import config_flags

from pspec_jax import cli

OUR_METHODS = ("none", "pld", "medusa", "eagle", "pspec")
HF_METHODS = ("hf", "hf_pld")
HF_PROMPT_LOOKUP_TOKENS = 10  # HF's suggested `prompt_lookup_num_tokens`


@dataclasses.dataclass(frozen=True)
class Setting:
  """One row of the results: what is decoded, and how."""

  method: str
  dataset: str
  temperature: float
  batch_size: int
  num_draft: int  # K as run (0 for none and hf)
  tree: str  # tree as run ("" for none and hf)
  drafts: str = ""  # at T > 0, how drafted nodes are chosen (DecodeConfig.drafts); "" if moot

  @property
  def baseline(self) -> "Setting":
    return Setting("none", self.dataset, self.temperature, self.batch_size, 0, "")

  def decode_config(self, *, max_new_tokens, eos_ids, pad_id, mesh=None):
    """The `pspec_jax.decode.DecodeConfig` this setting decodes with."""
    from pspec_jax import decode
    from pspec_jax.sampling import SamplingConfig

    return decode.DecodeConfig(
      max_new_tokens=max_new_tokens,
      sampling=SamplingConfig(temperature=self.temperature),
      eos_ids=eos_ids,
      pad_id=pad_id,
      num_draft=self.num_draft,
      tree=self.tree,
      mesh=mesh,
      **({"drafts": self.drafts} if self.drafts else {}),
    )


@dataclasses.dataclass
class Outcome:
  """What one call decoded: per sequence tokens, and for our methods rounds and acceptance."""

  tokens: list[list[int]]
  rounds: list[int] | None = None
  accepted: list[list[int]] | None = None
  chosen: dict[str, int] | None = None  # an adaptive tree's rounds per candidate


class OurMethod:
  """`none`, `pld`, `medusa`, `eagle`, `pspec`: pspec_jax.decode.generate.

  Prompts are padded to one `width` (0: their bucket), so a dataset compiles once.
  """

  def __init__(self, target, drafter, cfg, pad_id, width=0):
    self.target, self.drafter, self.cfg, self.pad_id = target, drafter, cfg, pad_id
    self.width = width

  def __call__(self, batch: list[list[int]], key) -> Outcome:
    import jax
    import numpy as np

    from pspec_jax import decode
    from pspec_jax import prompts as prompts_lib

    tokens, lengths = prompts_lib.pad_batch(batch, self.pad_id)
    if self.width > tokens.shape[1]:
      tokens = np.pad(
        tokens, ((0, 0), (0, self.width - tokens.shape[1])), constant_values=self.pad_id
      )
    out = jax.device_get(decode.generate(self.target, tokens, lengths, key, self.cfg, self.drafter))
    chosen = None
    if out.chosen is not None:
      candidates = decode.pool_tree(self.cfg, self.drafter).candidates
      chosen = {c.spec: int(n) for c, n in zip(candidates, out.chosen, strict=True)}
    return Outcome(
      tokens=[np.asarray(out.tokens[b, : out.lengths[b]]).tolist() for b in range(len(batch))],
      rounds=np.asarray(out.rounds).tolist(),
      accepted=np.asarray(out.accepted_per_depth).tolist(),
      chosen=chosen,
    )


class HFMethod:
  """`hf` / `hf_pld`: HF transformers' `generate` (PyTorch) on the same weights, in the same
  dtype, on a CUDA GPU when JAX runs on one, else on the CPU. In bfloat16 its rounding differs
  from JAX's, so its outputs can differ from `none`'s without either being wrong."""

  def __init__(self, spec, cfg, threads, prompt_lookup: bool, dtype: str = "float32"):
    import jax
    import torch
    import transformers

    from pspec_jax import checkpoints

    torch.set_num_threads(threads)
    self.device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    source = checkpoints.resolve_target(spec)
    if source.kind == "gguf":
      directory, filename = os.path.split(source.path)
      kwargs = dict(gguf_file=filename)
    else:
      directory, kwargs = source.path, {}
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=getattr(torch, dtype), **kwargs
    ).eval()
    self.model.to(self.device)
    self.cfg, self.prompt_lookup = cfg, prompt_lookup

  def __call__(self, batch: list[list[int]], key) -> Outcome:
    import jax
    import torch

    (ids,) = batch
    sampling = self.cfg.sampling
    torch.manual_seed(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    extra = dict(prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS) if self.prompt_lookup else {}
    with torch.inference_mode():
      out = self.model.generate(
        torch.tensor([ids], device=self.device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
        max_new_tokens=self.cfg.max_new_tokens,
        do_sample=not sampling.greedy,
        temperature=sampling.temperature or None,
        top_k=sampling.top_k or None,
        top_p=sampling.top_p,
        eos_token_id=list(self.cfg.eos_ids),
        pad_token_id=self.cfg.eos_ids[0],
        **extra,
      )
    return Outcome(tokens=[out[0, len(ids) :].tolist()])


def _values(value, kind) -> list:
  """A config list: "0,1" or a single number; "" is [""] for string lists (the default)."""
  parts = [p.strip() for p in str(value).split(",")] if value != "" else [""]
  if kind is str:
    return parts
  try:
    return [kind(p) for p in parts if p]
  except ValueError:
    raise ValueError(f"expected comma-separated {kind.__name__}s, got {value!r}") from None


def check_config(config) -> tuple[list, list, list, list, list, list]:
  """Everything the config says that needs no model, checked the same way by a run and by
  `--dry_run`: (methods, temperatures, batch sizes, Ks, trees, draft rules)."""
  from pspec_jax import decode, tree_specs
  from pspec_jax import prompts as prompts_lib

  if config.num_prompts < 1 or config.max_new_tokens < 1:
    raise ValueError("num_prompts and max_new_tokens must be >= 1")
  methods = _values(config.methods, str)
  known = OUR_METHODS + HF_METHODS
  unknown = sorted(set(methods) - set(known))
  if unknown or methods == [""]:
    raise ValueError(f"unknown methods {unknown}: known are {', '.join(known)}")
  for name in _values(config.datasets, str):
    if name not in prompts_lib.PROMPT_SETS:
      raise ValueError(f"unknown dataset {name!r}: known are {', '.join(prompts_lib.PROMPT_SETS)}")
  temperatures = _values(config.temperature, float)
  batch_sizes = _values(config.batch_size, int)
  ks = _values(config.num_draft, int) or [0]
  trees = _values(config.tree, str)
  if not temperatures or not batch_sizes:
    raise ValueError("give at least one temperature and one batch size")
  rules = _values(config.get("drafts", "sampled"), str)
  if not rules or set(rules) - set(decode.DRAFTS):
    raise ValueError(f"unknown drafts {config.drafts!r}: use {', '.join(decode.DRAFTS)}")
  if any(t < 0 for t in temperatures) or any(b < 1 for b in batch_sizes) or min(ks) < 0:
    raise ValueError("temperatures must be >= 0, batch sizes >= 1 and num_draft >= 0")
  for tree in trees:
    if tree:
      tree_specs.parse(tree, 64)  # the spelling; depth is checked per drafter below
  if config.out and os.path.exists(config.out) and not os.path.isdir(config.out):
    raise ValueError(f"out: {config.out} is a file, not a directory: give a directory")
  return methods, temperatures, batch_sizes, ks, trees, rules


def settings_of(config, target, drafters: dict) -> tuple[list[Setting], list[str]]:
  """Every setting the config asks for, and why any combination was left out."""
  from pspec_jax import decode, tree_specs

  methods, temperatures, batch_sizes, ks, trees, rules = check_config(config)
  out, skipped = [], []
  for dataset in _values(config.datasets, str):
    for temperature in temperatures:
      for batch in batch_sizes:
        for method in ["none"] + [m for m in methods if m != "none"]:
          if method in HF_METHODS or method == "none":
            if method in HF_METHODS and batch != 1:
              skipped.append(f"{method} at batch size {batch}: HF is measured at batch size 1")
              continue
            out.append(Setting(method, dataset, temperature, batch, 0, ""))
            continue
          drafter = drafters[method]
          for k in ks:
            for tree in trees:
              name = tree or drafter.cfg.tree_for(temperature == 0)
              cfg = decode.DecodeConfig(num_draft=k, tree=name)
              try:
                decode.check_drafter(target, drafter, cfg)
              except ValueError as e:
                skipped.append(f"{method} K={k or drafter.cfg.num_draft} tree {name}: {e}")
                continue
              own = drafter.cfg.num_draft
              if k and k != own and tree_specs.parse(name, k) == tree_specs.parse(name, own):
                # The row would say K=k and decode the drafter's own K: not a setting.
                skipped.append(f"{method} K={k} tree {name}: the tree fixes its own depth")
                continue
              for rule in rules:
                setting = Setting(
                  method, dataset, temperature, batch, k or drafter.cfg.num_draft, name, rule
                )
                drawn = dataclasses.replace(setting, drafts="sampled").decode_config(**_SHAPELESS)
                if not decode.drawn_from_q(drawn, drafter):
                  setting = dataclasses.replace(setting, drafts="")  # the rule changes nothing
                if setting not in out:
                  out.append(setting)
  return out, skipped


_SHAPELESS = dict(max_new_tokens=1, eos_ids=(), pad_id=0)


def phase_shares(target, drafter, batches, cfg) -> dict[str, float]:
  """Shares of a round spent in draft / verify / accept+commit, run phase by phase."""
  from infer.profile_round import phase_split

  ms, _ = phase_split(target, drafter, batches, cfg)
  total = sum(ms.values())
  return {k: v / total for k, v in ms.items()}


def read_bandwidth(num_bytes: int, repeats: int = 5) -> float:
  """Bytes per second of a large streaming read on the default device: a jitted sum over a
  float32 buffer of `num_bytes`, at least 256 MiB so no cache holds it and at most 1 GiB
  (median of a few). The rate at which a decoding step could read its weights, each once; a
  copy (read and write) gives less than this on a CPU, so a floor from it flatters a step."""
  import jax
  import numpy as np

  num_bytes = min(max(num_bytes, 1 << 28), 1 << 30)
  buffer = jax.numpy.ones(num_bytes // 4, np.float32)
  total = jax.jit(jax.numpy.sum)

  def read():
    jax.block_until_ready(total(buffer))

  read()  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    began = time.perf_counter()
    read()
    times.append(time.perf_counter() - began)
  return num_bytes / statistics.median(times)


def round_seconds(target, drafter, ids, cfg, repeats=3) -> tuple[float, int]:
  """Seconds per round of a whole decode, all its rounds in one jitted `while_loop`, and the
  rounds: (decode of `cfg.max_new_tokens` tokens - decode of 1) / rounds, so prefill cancels.
  Each decode's fastest of `repeats` runs, the one least disturbed by the machine.

  EOS is disabled so every run decodes exactly that many tokens.
  """
  import jax

  if cfg.max_new_tokens < 2:
    raise ValueError(f"timing rounds needs max_new_tokens >= 2, got {cfg.max_new_tokens}")
  key = jax.random.key(0)
  cfg = dataclasses.replace(cfg, eos_ids=())
  long_run = OurMethod(target, drafter, cfg, 0)
  short_run = OurMethod(target, drafter, dataclasses.replace(cfg, max_new_tokens=1), 0)
  rounds = long_run([ids], key).rounds[0]  # and compile
  short_run([ids], key)
  long_s, short_s = [], []
  for _ in range(repeats):
    for run, seconds in ((long_run, long_s), (short_run, short_s)):
      began = time.perf_counter()
      run([ids], key)
      seconds.append(time.perf_counter() - began)
  return (min(long_s) - min(short_s)) / rounds, rounds


def step_profile(target, ids, cfg, steps=64) -> dict:
  """`none`'s decode step against the memory-bandwidth floor: the time to read, once at the
  measured streaming-read bandwidth (`read_bandwidth`), every weight a step reads. All but
  the embedding table, of which it gathers a row, unless the table is the (tied) LM head too."""
  import jax

  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
  if not target.cfg.tie_embeddings:
    weight_bytes -= target.params["embedding"].nbytes
  step, _ = round_seconds(target, None, ids, dataclasses.replace(cfg, max_new_tokens=steps + 1))
  floor = weight_bytes / read_bandwidth(weight_bytes)
  return dict(
    weight_bytes=weight_bytes,
    decode_step_ms=step * 1e3,
    bandwidth_floor_ms=floor * 1e3,
    step_over_floor=step / floor,
  )


def load_prompts(config, tokenizer) -> dict[str, list[list[int]]]:
  """Encoded prompts per dataset: the first `num_prompts` of at most `max_prompt_tokens`."""
  from pspec_jax import prompts as prompts_lib

  chat = tokenizer.chat_template is not None
  out = {}
  for name in _values(config.datasets, str):
    if name not in prompts_lib.PROMPT_SETS:
      raise ValueError(f"unknown dataset {name!r}: known are {', '.join(prompts_lib.PROMPT_SETS)}")
    encoded = [prompts_lib.encode_prompt(tokenizer, p, chat) for p in prompts_lib.prompt_set(name)]
    out[name] = [ids for ids in encoded if len(ids) <= config.max_prompt_tokens]
    out[name] = out[name][: config.num_prompts]
    if not out[name]:
      raise ValueError(f"dataset {name!r} has no prompt of <= {config.max_prompt_tokens} tokens")
  return out


def dry_run(config) -> str:
  """The memory plan of the configured decoding (the largest batch, tree and K asked for)."""
  import jax.numpy as jnp

  from infer import plan
  from pspec_jax import checkpoints, sharding, tree_specs
  from pspec_jax import drafter as drafter_lib
  from pspec_jax import prompts as prompts_lib

  check_config(config)
  dtype = jnp.dtype(config.dtype)
  target = checkpoints.load_target_config(
    config.target, dtype=dtype, param_dtype=dtype, scan_layers=False
  )
  kinds = [m for m in _values(config.methods, str) if m in ("medusa", "eagle", "pspec")]
  ks = _values(config.num_draft, int) or [0]
  k = max(ks) or 4
  drafters = [drafter_lib.DrafterConfig.for_target(kind, target, num_draft=k) for kind in kinds]
  specs = [t or "chain" for t in _values(config.tree, str)]
  trees = [tree_specs.parse(t, k) for t in specs]
  largest = max(zip(specs, trees, strict=True), key=lambda st: st[1].num_verified)[0]
  shape = dict(
    batch=max(_values(config.batch_size, int)),
    prompt_width=prompts_lib.bucket(config.max_prompt_tokens),
    max_new_tokens=config.max_new_tokens,
  )
  mesh = sharding.parse_mesh(config.mesh)
  table = plan.decode_memory_table(
    target,
    drafters,
    **shape,
    tree_nodes=max(t.num_verified for t in trees),
    tree_depth=max(t.max_depth for t in trees),
    hardware=config.hardware,
    mesh=mesh,
  )
  compiled = plan.compiled_decode_table(
    target, drafters, hardware=config.hardware, mesh=mesh, tree=largest, **shape
  )
  return f"{table}\n{compiled}"


def measure(settings, runners, prompts, seed, time_split=None, progress=True) -> list[dict]:
  """The result rows of `settings`, each decoded by `runners[setting]` over `prompts[dataset]`.

  Settings are compared within a family (dataset, temperature, batch size), whose every
  setting decodes the same prompt batches; one family is compiled and run at a time.
  `time_split(setting)`, if given, adds a row's draft / verify / commit shares.
  """
  import jax
  from tqdm import tqdm

  families = {}
  for s in settings:
    families.setdefault((s.dataset, s.temperature, s.batch_size), []).append(s)
  records = {s: [] for s in settings}
  shares = {}
  for family in families.values():
    ids, size = prompts[family[0].dataset], family[0].batch_size
    family_batches = [ids[i : i + size] for i in range(0, len(ids), size)]
    # Compile and warm up every setting (and a short last batch) before anything is timed.
    for s in tqdm(family, desc="compile", file=sys.stderr, disable=not progress):
      for batch in {len(b): b for b in family_batches}.values():
        runners[s](batch, jax.random.key(seed))
    # Interleaved: for each prompt batch, every setting in turn.
    for index, batch in enumerate(
      tqdm(family_batches, desc="prompts", file=sys.stderr, disable=not progress)
    ):
      key = jax.random.fold_in(jax.random.key(seed), index)
      for s in family:
        began = time.perf_counter()
        outcome = runners[s](batch, key)
        records[s].append((time.perf_counter() - began, outcome))
    if time_split is not None:
      for s in tqdm(family, desc="time split", file=sys.stderr, disable=not progress):
        shares[s] = time_split(s)
    # A compiled program holds hundreds of memory mappings (its JIT-linked kernels); a sweep
    # that kept every family's would run into the kernel's limit on them (vm.max_map_count).
    jax.clear_caches()
  return [_row(s, records, shares.get(s)) for s in settings]


def run(config, progress=True) -> dict:
  import jax
  import transformers

  from pspec_jax import checkpoints, decode, drafter_files, sharding
  from pspec_jax import prompts as prompts_lib

  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  methods = check_config(config)[0]
  if any(m in HF_METHODS for m in methods):
    # On a GPU, torch's copy of the target shares the card: JAX takes memory as it needs it
    # instead of 75% up front (effective when JAX has not started yet, as in a program).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
      import torch  # noqa: F401
    except ImportError:
      raise ValueError("methods hf and hf_pld need torch: pip install -e '.[test]'") from None
  tokenizer = checkpoints.load_tokenizer(config.target)
  prompts = load_prompts(config, tokenizer)
  mesh = sharding.make_mesh(**sharding.parse_mesh(config.mesh)) if config.mesh else None
  dtype = jax.numpy.dtype(config.dtype)
  target = checkpoints.load_target(
    config.target,
    dtype=dtype,
    param_dtype=dtype,
    scan_layers=False,
    untie_head=True,
    weight_layout=config.weight_layout,
    mesh=mesh,
  )
  drafters, drafter_meta = {}, {}
  for method in methods:
    if method in ("pld", "medusa", "eagle", "pspec"):
      spec = None
      if method != "pld":
        spec = os.path.join(config.drafter_dir, method) if config.drafter_dir else None
        spec = spec or drafter_files.shipped_drafter(target.cfg.name, method)
      drafters[method] = drafter_files.resolve_drafter(method, spec, target)
      drafter_meta[method] = _drafter_meta(drafters[method], spec)
  if mesh is not None:
    drafters = {m: decode.shard(mesh, target, d)[1] for m, d in drafters.items()}
  settings, skipped = settings_of(config, target, drafters)
  eos_ids = checkpoints.eos_token_ids(config.target, tokenizer)
  pad_id = tokenizer.pad_token_id or 0

  def decode_config(s: Setting) -> decode.DecodeConfig:
    return s.decode_config(
      max_new_tokens=config.max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, mesh=mesh
    )

  def costs(s: Setting, cfg) -> tuple:
    """An adaptive tree's round costs on this machine (measured once, then read back)."""
    from infer import calibration

    drafter = drafters.get(s.method)
    if drafter is None or not decode.pool_tree(cfg, drafter).candidates:
      return ()
    first = prompts[s.dataset][0]
    return calibration.costs_for(target, drafter, cfg, s.batch_size, first)

  runners = {}
  for s in settings:
    if s.method in HF_METHODS:
      runners[s] = HFMethod(
        config.target,
        decode_config(s),
        config.torch_threads,
        prompt_lookup=s.method == "hf_pld",
        dtype=config.dtype,
      )
    else:
      width = prompts_lib.bucket(max(map(len, prompts[s.dataset])))
      cfg = decode_config(s)
      cfg = dataclasses.replace(cfg, costs=costs(s, cfg))
      runners[s] = OurMethod(target, drafters.get(s.method), cfg, pad_id, width)

  def time_split(s: Setting) -> dict[str, float] | None:
    if s.method not in OUR_METHODS or not config.phase_prompts:
      return None
    head = prompts[s.dataset][: config.phase_prompts]
    return phase_shares(target, drafters.get(s.method), head, decode_config(s))

  rows = measure(settings, runners, prompts, config.seed, time_split, progress)

  meta = dict(
    machine=platform.platform(),
    processor=platform.processor() or platform.machine(),
    cpu_count=os.cpu_count(),
    devices=[str(d) for d in jax.devices()],
    jax_version=jax.__version__,
    target=config.target,
    drafters=drafter_meta,
    config=config.to_dict(),
    skipped=skipped,
  )
  if config.step_profile and "none" in methods:
    first = next(iter(prompts.values()))[0]
    meta.update(step_profile(target, first, decode_config(settings[0])))
  return dict(meta=meta, rows=rows)


def _drafter_meta(drafter, directory: str | None) -> dict:
  from pspec_jax import drafter_files

  c = drafter.cfg
  meta = dict(
    kind=c.kind,
    num_draft=c.num_draft,
    tree=c.tree,
    sampling_tree=c.tree_for(greedy=False),
    source=directory,
  )
  if directory:
    with open(os.path.join(directory, drafter_files.CONFIG_FILE)) as fh:
      meta.update(trained_steps=json.load(fh).get("trained_steps"))
    meta.update(draft_vocab_size=c.draft_vocab_size)
  return meta


def _row(s: Setting, records: dict, shares: dict | None) -> dict:
  runs = records[s]
  seconds = sum(t for t, _ in runs)
  seqs = [seq for _, o in runs for seq in o.tokens]
  num_tokens = sum(len(seq) for seq in seqs)
  tokens_per_s = num_tokens / seconds
  base = records.get(s.baseline)
  speedup = tau = accept = lossless = None
  per_prompt_tau = []
  if base is not None:
    base_tokens = sum(len(q) for _, o in base for q in o.tokens)
    speedup = tokens_per_s / (base_tokens / sum(t for t, _ in base))
    if s.temperature == 0:
      base_seqs = [seq for _, o in base for seq in o.tokens]
      lossless = seqs == base_seqs
  if runs[0][1].rounds is not None:
    rounds = [r for _, o in runs for r in o.rounds]
    accepted = [a for _, o in runs for a in o.accepted]
    tau = sum(len(q) - 1 for q in seqs) / max(sum(rounds), 1)
    per_prompt_tau = [(len(q) - 1) / max(r, 1) for q, r in zip(seqs, rounds, strict=True)]
    depth = len(accepted[0])
    accept = [sum(a[d] for a in accepted) / max(sum(rounds), 1) for d in range(depth)]
  elif s.method == "hf":
    tau, per_prompt_tau = 1.0, [1.0] * len(seqs)
  chosen = None
  if runs[0][1].chosen is not None:
    chosen = {name: sum(o.chosen[name] for _, o in runs) for name in runs[0][1].chosen}
  return dict(
    method=s.method,
    dataset=s.dataset,
    temperature=s.temperature,
    batch_size=s.batch_size,
    num_draft=s.num_draft,
    tree=s.tree,
    drafts=s.drafts,
    tokens_per_s=tokens_per_s,
    speedup=speedup,
    tau=tau,
    accept_per_depth=accept,
    draft_share=None if shares is None else shares["draft"],
    verify_share=None if shares is None else shares["verify"],
    commit_share=None if shares is None else shares["accept+commit"],
    lossless=lossless,
    num_prompts=len(seqs),
    tokens=num_tokens,
    seconds=seconds,
    tau_per_prompt=per_prompt_tau,
    chosen=chosen,
  )


# ---------------------------------------------------------------------------------------------
# Report and plots


def _label(r: dict, varied: set[str]) -> str:
  label = r["method"]
  if r["method"] not in ("none", *HF_METHODS):
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
      f"measured read bandwidth): ratio {meta['step_over_floor']:.2f}.",
    ]
  return "\n".join(lines) + "\n"


def _chosen_table(rows: list[dict]) -> list[str]:
  """How often each candidate of an adaptive tree was chosen, per setting (share of rounds)."""
  adaptive = [r for r in rows if r.get("chosen")]
  if not adaptive:
    return []
  lines = [
    "",
    "## Adaptive trees: share of rounds per candidate",
    "",
    "| method | dataset | T | batch | candidate: share of rounds |",
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


def plots(results: dict, out: str) -> list[str]:
  """speedup.png, tau.png and (when K varies) k_ablation.png in `out`; returns their names."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  rows = results["rows"]
  varied = _varied(rows)
  first = [
    r
    for r in rows
    if (r["temperature"], r["batch_size"]) == (rows[0]["temperature"], rows[0]["batch_size"])
  ]
  datasets = list(dict.fromkeys(r["dataset"] for r in first))
  labels = list(dict.fromkeys(_label(r, varied) for r in first))
  written = []

  fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * len(datasets)), 4))
  width = 0.8 / len(datasets)
  for i, dataset in enumerate(datasets):
    values = []
    for label in labels:
      hit = [r for r in first if r["dataset"] == dataset and _label(r, varied) == label]
      values.append(hit[0]["speedup"] or 0 if hit else 0)
    ax.bar(np.arange(len(labels)) + i * width, values, width, label=dataset)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=20, ha="right")
  ax.set_ylabel("speedup over none")
  ax.set_title(f"T={rows[0]['temperature']}, batch {rows[0]['batch_size']}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "speedup.png"), dpi=120)
  plt.close(fig)
  written.append("speedup.png")

  drafted = [r for r in first if r["tau_per_prompt"] and r["method"] not in ("none", "hf")]
  if drafted:
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(drafted)), 4))
    ax.boxplot(
      [r["tau_per_prompt"] for r in drafted],
      tick_labels=[f"{_label(r, varied)}\n{r['dataset']}" for r in drafted],
    )
    ax.set_ylabel("tau per prompt (tokens per target pass)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "tau.png"), dpi=120)
    plt.close(fig)
    written.append("tau.png")

  if "num_draft" in varied:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
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
    left.set_xlabel("K"), left.set_ylabel("speedup over none")
    right.set_xlabel("K"), right.set_ylabel("tau")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "k_ablation.png"), dpi=120)
    plt.close(fig)
    written.append("k_ablation.png")
  return written


def main():
  config = flags.FLAGS.config
  if flags.FLAGS.dry_run:
    print(dry_run(config))
    return
  results = run(config)
  out = config.out or os.path.join(
    "bench_results", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  )
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.json"), "w") as fh:
    json.dump(results, fh, indent=2)
  text = report(results)
  with open(os.path.join(out, "report.md"), "w") as fh:
    fh.write(text)
  plots(results, out)
  print(text)
  print(f"results in {out}/")


def define_flags():
  """Defines the command line; only when run as a program, so the CLI modules import together."""
  config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "bench_default.py")
  )
  flags.DEFINE_bool(
    "dry_run",
    False,
    "Print per-device memory of decoding on config.mesh and config.hardware; allocates nothing.",
  )


if __name__ == "__main__":
  cli.run(main, define_flags, full_float32=True)
