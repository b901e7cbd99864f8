"""What the project's command-line programs share: one way to run a main, and a compile clock.

Every program (`train.distill`, `train.selfdistill`, `infer.generate`, `infer.bench`,
`infer.profile_round`, `infer.tune_tree`) ends bad input with one `error:` line and exit code 1,
never a traceback: a bad `--config` (an unknown key, variant or file) and any `ValueError`
(or `FloatingPointError`, a diverged training run) raised by its main; the error line starts
a line of its own, after any progress bar. `--help` exits 0. Each keeps what XLA
compiles for the next run (`keep_compiled_programs`). The decoding programs (`infer.*`)
compute float32 matrix products in float32 (`full_float32_matmuls`).
"""

import contextlib
import os
import sys

from absl import app, flags, logging

import pspec_jax

FLAGS = flags.FLAGS


@contextlib.contextmanager
def _flag_errors():
  """Bad flags, and a config file that fails to load or override, as one `error:` line."""
  try:
    yield
  except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    # ml_collections reports an unknown key as AttributeError("'name'"); absl wraps errors of
    # the config file in a flags.Error whose last line is the cause.
    lines = str(e).strip().splitlines() or [type(e).__name__]
    reason = lines[-1].strip() if isinstance(e, flags.Error | OSError) else lines[0]
    if isinstance(e, AttributeError | KeyError):
      reason = f"unknown config key {reason.strip(chr(34) + chr(39))!r}"
    sys.exit(f"error: {reason}")


_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _parse(argv):
  with _flag_errors():
    try:
      rest = FLAGS(argv)
    except SystemExit as e:
      # absl exits with code 1 after printing the help it was asked for; asking is no error.
      if e.code == 1 and any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
        sys.exit(0)
      raise
    if "config" in FLAGS and FLAGS.config is not None:
      FLAGS.config.keys()  # a config file that failed to load raises on first use
  return rest


def keep_compiled_programs(max_bytes: int = 4 << 30) -> None:
  """Compiled programs are kept under `pspec_jax.cache_dir("xla")` (up to `max_bytes`, or
  `JAX_COMPILATION_CACHE_MAX_SIZE`; least recently used dropped first), so a second run skips
  compiling them again. A cache directory the user set (`JAX_COMPILATION_CACHE_DIR`) is used
  as it is; `JAX_ENABLE_COMPILATION_CACHE=false` turns caching off."""
  import jax

  if jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", pspec_jax.cache_dir("xla"))
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", max_bytes)


def full_float32_matmuls() -> contextlib.AbstractContextManager:
  """Matrix products of float32 operands in full float32 precision (`jax.default_matmul_
  precision("highest")`), unless the user chose one (`JAX_DEFAULT_MATMUL_PRECISION`, or
  `jax.config.update("jax_default_matmul_precision", ...)`).

  By default GPUs multiply float32 in TF32 (and TPUs in bfloat16 passes), whose rounding
  differs between a tree's verification and a plain decoding step: greedy speculative output
  can then differ from plain decoding's where two tokens nearly tie (seen for medusa in
  `infer.bench` on an H100). XLA:CPU multiplies float32 in float32 either way; bfloat16
  operands are not affected.
  """
  import jax

  if jax.config.jax_default_matmul_precision is not None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision("highest")


def run(main, define_flags, full_float32: bool = False) -> None:
  """Defines the flags (`define_flags()`), parses them and runs `main()` as the program.

  A config file with a default is loaded, and its overrides applied, as its flag is defined.
  `full_float32`: run `main` under `full_float32_matmuls()` (the decoding programs).
  """
  with _flag_errors():
    define_flags()

  def guarded(argv):
    if len(argv) > 1:
      sys.exit(f"error: unexpected arguments {argv[1:]}: flags are written --name=value")
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # jax logs its backend probing at INFO
    keep_compiled_programs()
    # Deferred to here, past the flags, so that `--help` needs no transformers.
    import transformers

    transformers.logging.set_verbosity_error()  # its warnings about tokenizers and models
    try:
      with full_float32_matmuls() if full_float32 else contextlib.nullcontext():
        main()
    except (ValueError, FloatingPointError) as e:
      _close_progress_bars()
      sys.exit(f"error: {e}")

  app.run(guarded, flags_parser=_parse)


def _close_progress_bars() -> None:
  """Ends every open tqdm bar's line, so that an error line starts a line of its own."""
  tqdm = sys.modules.get("tqdm")
  for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
    bar.close()


class CompileClock:
  """Seconds JAX spent tracing, lowering and compiling programs (or reading them from the
  compilation cache) while the clock ran: `with CompileClock() as clock: ...; clock.seconds`.

  Nested events (a jitted function traced inside another) are counted once: the union of
  their time spans is what is summed.
  """

  _PREFIX = "/jax/core/compile/"

  def __init__(self):
    self._spans: list[tuple[float, float]] = []

  def _listen(self, event: str, start: float, end: float, **_) -> None:
    if event.startswith(self._PREFIX):
      self._spans.append((start, end))

  def __enter__(self) -> "CompileClock":
    import jax

    jax.monitoring.register_event_time_span_listener(self._listen)
    return self

  def __exit__(self, *exc) -> None:
    import jax

    jax.monitoring.unregister_event_time_span_listener(self._listen)

  @property
  def seconds(self) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(self._spans):
      if end > reach:
        total += end - max(start, reach)
        reach = end
    return total
