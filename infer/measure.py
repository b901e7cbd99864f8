"""Measuring decoding: the methods as runners, one timer, and the interleaved measurement.

Shared by the measuring programs (`infer.bench`, `infer.tune_tree`, `infer.profile_round`).
Every time here comes from `timed`: wall-clock seconds of a call, waiting for its result on the
device. A measurement compiles and warms up what it times first, and settings compared with
each other take turns (prompt batch by prompt batch, or round by round), so machine noise hits
them alike.
"""

import dataclasses
import math
import os
import statistics
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from pspec_jax import checkpoints, cpu_kernel, decode, panels
from pspec_jax import prompts as prompts_lib
from pspec_jax.sampling import SamplingConfig

OUR_METHODS = ("none", "pld", "medusa", "eagle", "pspec")
HF_METHODS = ("hf", "hf_pld")
HF_PROMPT_LOOKUP_TOKENS = 10  # HF's suggested `prompt_lookup_num_tokens`


def timed(fn, *args):
  """(fn(*args), seconds), waiting for the result on the device."""
  began = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - began


def median_ms(fn, *args, repeats: int) -> float:
  """Median ms of `repeats` calls of `fn(*args)`, after one call that compiles it."""
  return interleaved_ms({"": (fn, *args)}, repeats)[""]


def interleaved_ms(calls: dict, repeats: int) -> dict:
  """Median ms per named call {name: (fn, *args)}: each is called once (compiling it), then
  all are timed in turns, `repeats` times, so drift on the machine hits them alike."""
  times = interleaved_times(calls, repeats)
  return {name: statistics.median(t) for name, t in times.items()}


def interleaved_times(calls: dict, repeats: int) -> dict[str, list[float]]:
  """`interleaved_ms`' every time, in ms per named call: turn r's time is item r of each list,
  so times of one turn can be compared with each other (`paired_ratio`)."""
  for fn, *args in calls.values():
    timed(fn, *args)
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, (fn, *args) in calls.items():
      times[name].append(1e3 * timed(fn, *args)[1])
  return times


def paired_ratio(times, base) -> float:
  """The median over turns of times[r] / base[r] (sequences of the same length), both timed in
  turn r (`interleaved_times`).
  On a shared machine the speed drifts by tens of percent within a minute; each turn's ratio
  is taken at one speed, and so is steadier than a ratio of the two medians. A turn where
  either time is NaN (not timed) is left out."""
  ratios = [t / b for t, b in zip(times, base, strict=True)]
  return statistics.median(r for r in ratios if not math.isnan(r))


def encode_prompts(
  tokenizer, prompts, *, source: str, count: int, max_tokens: int | None = None
) -> list[list[int]]:
  """The first `count` of `prompts` of at most `max_tokens` tokens (None: any), encoded for
  `tokenizer` (with its chat template when it has one). ValueError if none fits; `source`
  names the prompts in it."""
  chat = tokenizer.chat_template is not None
  out = []
  for prompt in prompts:
    if len(out) == count:
      break
    ids = prompts_lib.encode_prompt(tokenizer, prompt, chat)
    if max_tokens is None or len(ids) <= max_tokens:
      out.append(ids)
  if not out:
    raise ValueError(f"{source} has no prompt of <= {max_tokens} tokens")
  return out


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

  def decode_config(self, *, max_new_tokens, eos_ids, pad_id, mesh=None, sampled_eos=False):
    """The `pspec_jax.decode.DecodeConfig` this setting decodes with. Sampled (T > 0), it
    decodes `max_new_tokens` past any EOS unless `sampled_eos`: a sampled answer's length is a
    random draw, another for each method, and one that stops early carries more of its prompt's
    prefill per token, which is not a speed of its method."""
    stops = self.temperature == 0 or sampled_eos
    return decode.DecodeConfig(
      max_new_tokens=max_new_tokens,
      sampling=SamplingConfig(temperature=self.temperature),
      eos_ids=eos_ids if stops else (),
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


def verified_trees(candidates, chosen, chained) -> dict[str, int]:
  """Rounds per tree an adaptive decode verified, from its rounds per candidate (`chosen`) and
  those that also verified the candidate's lookup chain (`chained`): a candidate whose chain
  was left out, or found nowhere, verified its drafted tree alone (the root alone for a bare
  chain), which counts under that tree's name."""
  out = {}
  for cand, n, with_chain in zip(candidates, chosen, chained, strict=True):
    for tree, rounds in ((cand.drafted, n - with_chain), (cand, with_chain)):
      out[tree.spec] = out.get(tree.spec, 0) + int(rounds)
  return out


class OurMethod:
  """`none`, `pld`, `medusa`, `eagle`, `pspec`: pspec_jax.decode.generate.

  Prompts are padded to one `width` (0: their bucket), so a dataset compiles once.
  """

  def __init__(self, target, drafter, cfg, pad_id, width=0):
    self.target, self.drafter, self.cfg, self.pad_id = target, drafter, cfg, pad_id
    self.width = width

  def __call__(self, batch: list[list[int]], key) -> Outcome:
    tokens, lengths = prompts_lib.pad_batch(batch, self.pad_id)
    if self.width > tokens.shape[1]:
      tokens = np.pad(
        tokens, ((0, 0), (0, self.width - tokens.shape[1])), constant_values=self.pad_id
      )
    out = jax.device_get(decode.generate(self.target, tokens, lengths, key, self.cfg, self.drafter))
    chosen = None
    if out.chosen is not None:
      candidates = decode.resolve_tree(self.cfg, self.drafter).candidates
      chosen = verified_trees(candidates, out.chosen, out.chained)
    return Outcome(
      tokens=[np.asarray(out.tokens[b, : out.lengths[b]]).tolist() for b in range(len(batch))],
      rounds=np.asarray(out.rounds).tolist(),
      accepted=np.asarray(out.accepted_per_depth).tolist(),
      chosen=chosen,
    )


class HFMethod:
  """`hf` / `hf_pld`: HF transformers' `generate` (PyTorch) on the same weights, in the same
  dtype, on a CUDA GPU when JAX runs on one, else on the CPU. In bfloat16 its rounding differs
  from JAX's, so its outputs can differ from `none`'s without either being wrong. A target
  decoding from GGUF blocks computes with 8-bit activations (llama.cpp's arithmetic), HF with
  the dequantised float weights: `same_model=False`, and its rows have no lossless check.

  torch is imported here, not with the module: it is an optional dependency (`.[test]`).
  """

  def __init__(
    self, spec, cfg, threads, prompt_lookup: bool, dtype: str = "float32", same_model=True
  ):
    import torch
    import transformers

    transformers.logging.disable_progress_bar()  # its checkpoint-loading bar
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
    self.cfg, self.prompt_lookup, self.torch = cfg, prompt_lookup, torch
    self.same_model = same_model

  def __call__(self, batch: list[list[int]], key) -> Outcome:
    torch = self.torch
    (ids,) = batch
    sampling = self.cfg.sampling
    torch.manual_seed(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    extra = dict(prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS) if self.prompt_lookup else {}
    if not self.cfg.eos_ids:  # decode max_new_tokens whatever comes, as pspec_jax does
      extra.update(min_new_tokens=self.cfg.max_new_tokens)
    with torch.inference_mode():
      out = self.model.generate(
        torch.tensor([ids], device=self.device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
        max_new_tokens=self.cfg.max_new_tokens,
        do_sample=not sampling.greedy,
        temperature=sampling.temperature or None,
        top_k=sampling.top_k or None,
        top_p=sampling.top_p,
        eos_token_id=list(self.cfg.eos_ids) or None,
        pad_token_id=self.cfg.pad_id,
        **extra,
      )
    return Outcome(tokens=[out[0, len(ids) :].tolist()])


def measure(
  settings, runners, prompts, seed, time_split=None, progress=True, turns: int = 1
) -> list[dict]:
  """The result rows of `settings`, each decoded by `runners[setting]` over `prompts[dataset]`.

  Settings are compared within a family (dataset, temperature, batch size), whose every
  setting decodes the same prompt batches; one family is compiled and run at a time. Each
  prompt batch is decoded `turns` times by every setting in turn, in the family's order and
  then in reverse, so that no setting always runs first; a batch's time is the median over its
  turns (each turn decodes the same tokens: the same prompts and key). On a shared machine one
  decode of a prompt can take tens of percent longer than the next; a median over turns
  leaves such hiccups out. `time_split(setting)`, if given, adds a row's draft / verify /
  commit shares.
  """
  if turns < 1:
    raise ValueError(f"turns must be at least 1, got {turns}")
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
    # Interleaved: for each prompt batch, every setting in turn, `turns` times.
    for index, batch in enumerate(
      tqdm(family_batches, desc="prompts", file=sys.stderr, disable=not progress)
    ):
      key = jax.random.fold_in(jax.random.key(seed), index)
      times = {s: [] for s in family}
      outcomes = {}
      for turn in range(turns):
        for s in family if turn % 2 == 0 else family[::-1]:
          outcome, seconds = timed(runners[s], batch, key)
          outcomes.setdefault(s, outcome)
          times[s].append(seconds)
      for s in family:
        records[s].append((statistics.median(times[s]), outcomes[s]))
    if time_split is not None:
      for s in tqdm(family, desc="time split", file=sys.stderr, disable=not progress):
        shares[s] = time_split(s)
    # A compiled program holds hundreds of memory mappings (its JIT-linked kernels); a sweep
    # that kept every family's would run into the kernel's limit on them (vm.max_map_count).
    jax.clear_caches()
  return [
    _row(s, records, shares.get(s), getattr(runners[s], "same_model", True)) for s in settings
  ]


def _row(s: Setting, records: dict, shares: dict | None, same_model: bool = True) -> dict:
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
    if s.temperature == 0 and same_model:
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


def phase_split(target, drafter, prompts, cfg):
  """Median ms per round of each phase over every round of every prompt (after warm-up), each
  phase jitted on its own and timed from the host; and the rounds timed."""
  if drafter is not None:
    drafter = drafter.with_head(target)  # as `decode.generate` does, once per decode
  times = {"draft": [], "verify": [], "accept+commit": []}
  for warm_up in (True, False):
    for ids in prompts[:1] if warm_up else prompts:
      tokens, lengths = prompts_lib.pad_batch([ids])
      plan = decode.make_plan(cfg, drafter, tokens.shape[1])
      state = decode.init(plan, target, drafter, tokens, lengths, jax.random.key(0))
      while not bool(state.done.all()):
        verified, t_verify = timed(decode.verify, plan, target, drafter, state)
        (state, pairs), t_commit = timed(decode.commit, plan, state, verified)
        state, t_draft = timed(decode.draft, plan, target, drafter, state, pairs)
        if not warm_up:
          times["verify"].append(t_verify)
          times["accept+commit"].append(t_commit)
          times["draft"].append(t_draft)
  return {k: 1e3 * statistics.median(v) for k, v in times.items()}, len(times["draft"])


def phase_shares(target, drafter, batches, cfg) -> dict[str, float] | None:
  """Shares of a round spent in draft / verify / accept+commit, run phase by phase; None for
  an adaptive tree, whose round verifies, accepts and commits in one step."""
  if decode.resolve_tree(cfg, drafter).candidates:
    return None
  ms, _ = phase_split(target, drafter, batches, cfg)
  total = sum(ms.values())
  return {k: v / total for k, v in ms.items()}


def _readers(num_bytes: int) -> tuple[dict, int]:
  """`read_bandwidth`'s streaming reads as `interleaved_times` calls, and the bytes each reads."""
  num_bytes = min(max(num_bytes, 1 << 28), 1 << 30)
  panel = 1024 * panels.WIDTH  # floats in one [1024, 64] panel
  num_bytes -= num_bytes % (4 * panel)
  buffer = jax.numpy.ones(num_bytes // 4, np.float32)
  readers = {"sum": (jax.jit(jax.numpy.sum), buffer)}
  if jax.default_backend() == "cpu" and cpu_kernel.available():
    w = buffer.reshape(-1, 1024, panels.WIDTH)
    x = jax.numpy.ones((1, 1024), np.float32)
    readers["kernel"] = (jax.jit(cpu_kernel.matmul, static_argnums=2), x, w, w.shape[0] * 64)
  return readers, num_bytes


def read_bandwidth(num_bytes: int, repeats: int = 5) -> float:
  """Bytes per second of a large streaming read on the default device, at least 256 MiB so no
  cache holds it and at most 1 GiB: a jitted sum over a float32 buffer, and on a CPU with the
  panel kernel also that kernel's one-row product over the same bytes (it reads on every core,
  where XLA:CPU's sum reads on one); the faster reader's median of a few, taken in turns. The
  rate at which a decoding step could read its weights, each once; a copy (read and write)
  gives less than this on a CPU, so a floor from it would flatter a step."""
  readers, read_bytes = _readers(num_bytes)
  times = interleaved_times(readers, repeats)
  return read_bytes / (min(statistics.median(t) for t in times.values()) / 1e3)


def _decode_runs(target, drafter, ids, cfg) -> tuple[dict, int]:
  """A whole decode of `cfg.max_new_tokens` tokens and one of 1 (EOS off, so every run decodes
  exactly that many), as `interleaved_times` calls {"long", "short"}, and the long one's rounds
  (it compiles here)."""
  if cfg.max_new_tokens < 2:
    raise ValueError(f"timing rounds needs max_new_tokens >= 2, got {cfg.max_new_tokens}")
  key = jax.random.key(0)
  cfg = dataclasses.replace(cfg, eos_ids=())
  long_run = OurMethod(target, drafter, cfg, 0)
  short_run = OurMethod(target, drafter, dataclasses.replace(cfg, max_new_tokens=1), 0)
  rounds = long_run([ids], key).rounds[0]
  return {"long": (long_run, [ids], key), "short": (short_run, [ids], key)}, rounds


def round_seconds(target, drafter, ids, cfg, repeats=3) -> tuple[float, int]:
  """Seconds per round of a whole decode, all its rounds in one jitted `while_loop`, and the
  rounds: (decode of `cfg.max_new_tokens` tokens - decode of 1) / rounds, so prefill cancels.
  Each decode's fastest of `repeats` runs, the one least disturbed by the machine.

  EOS is disabled so every run decodes exactly that many tokens.
  """
  calls, rounds = _decode_runs(target, drafter, ids, cfg)
  short_run, *args = calls["short"]
  short_run(*args)  # compiles
  seconds = {name: [] for name in calls}
  for _ in range(repeats):
    for name, (run, *args) in calls.items():
      seconds[name].append(timed(run, *args)[1])
  return (min(seconds["long"]) - min(seconds["short"])) / rounds, rounds


def step_profile(target, ids, cfg, steps=64, turns=7) -> dict:
  """`none`'s decode step against the memory-bandwidth floor: the time to read, once at the
  measured streaming-read bandwidth (`read_bandwidth`), every weight a step reads. All but
  the embedding table, of which it gathers a row, unless the table is the (tied) LM head too.

  The step (a decode of `steps` + 1 tokens less one of 1, over the rounds between) and the
  floor are timed in the same turns, and the ratio is the median over turns of each turn's own
  (`paired_ratio`): on a shared machine the speed drifts by tens of percent within a minute, and
  a step and a floor timed apart once gave a ratio below 1."""
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
  if not target.cfg.tie_embeddings:
    weight_bytes -= target.params["embedding"].nbytes
  decodes, rounds = _decode_runs(
    target, None, ids, dataclasses.replace(cfg, max_new_tokens=steps + 1)
  )
  readers, read_bytes = _readers(weight_bytes)
  times = interleaved_times({**decodes, **readers}, turns)
  step_ms = [(a - b) / rounds for a, b in zip(times["long"], times["short"], strict=True)]
  read_ms = [min(t) for t in zip(*(times[name] for name in readers), strict=True)]
  floor_ms = [t * weight_bytes / read_bytes for t in read_ms]
  return dict(
    weight_bytes=weight_bytes,
    decode_step_ms=statistics.median(step_ms),
    bandwidth_floor_ms=statistics.median(floor_ms),
    step_over_floor=paired_ratio(step_ms, floor_ms),
  )
