"""What the training mains share: config-flag errors and bad input as one `error:` line."""

import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS


def run(main) -> None:
  """Parses the flags (the config file and its overrides) and runs `main(argv)`.

  Errors in the config (an unknown key, a bad value or variant) and `ValueError`s from `main`
  (bad input) end the program with one line and exit code 1, never a traceback.
  """
  flags.mark_flags_as_required(["config"])

  def parse(argv):
    try:
      rest = FLAGS(argv)
      FLAGS.config.keys()  # a config file that failed to load raises on first use
    except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
      # ml_collections reports an unknown key as AttributeError("'name'"); absl wraps errors
      # of the config file in a flags.Error whose last line is the cause.
      lines = str(e).strip().splitlines() or [type(e).__name__]
      reason = lines[-1].strip() if isinstance(e, flags.Error | OSError) else lines[0]
      if isinstance(e, AttributeError | KeyError):
        reason = f"unknown config key {reason.strip(chr(34) + chr(39))!r}"
      sys.exit(f"error: bad --config: {reason}")
    return rest

  def guarded(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)  # jax logs its backend probing at INFO
    try:
      main(argv)
    except (ValueError, FloatingPointError) as e:
      sys.exit(f"error: {e}")

  app.run(guarded, flags_parser=parse)
