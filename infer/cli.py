"""What the measuring mains share: bad input as one `error:` line, and timing a jitted call."""

import sys
import time

from absl import app, logging


def guarded(run):
  """An absl main that runs `run()`; a `ValueError` (bad input) ends it with one line."""

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    try:
      run()
    except ValueError as e:
      sys.exit(f"error: {e}")

  return main


def timed(fn, *args):
  """(fn(*args), seconds), waiting for the result on the device."""
  import jax

  began = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - began
