"""Resuming a run from its workdir: the newest checkpoint that reads back whole and finite.

A checkpoint can be damaged after it was committed (a disk filled up, a file truncated or
emptied by hand, a copy cut short). Resuming tries the checkpoints newest first; one that
fails to restore, or that holds a non-finite number, is skipped and the next older one tried.
Once one restores, the skipped ones are moved aside (under `checkpoints_damaged/` next to
`checkpoints/`; deleted on an object store, which cannot move a directory), so that the run
saves those steps again. When none restores, nothing is moved and the run stops.
"""

import dataclasses
import shutil
import sys

__all__ = ["Restored", "restore_newest", "set_aside"]


@dataclasses.dataclass
class Restored:
  state: object  # the TrainState, or None when no checkpoint restored
  meta: dict | None
  step: int | None
  skipped: list[str]  # "step N: why", newest first


def _reason(error: Exception) -> str:
  """One short line for a failed restore; orbax's messages run to hundreds of lines."""
  import json
  import re

  text = str(error)
  if "TensorStore" in text:
    arrays = re.findall(r"'path': '([^/'][^']*)/'", text)
    which = f"the array {arrays[-1]}" if arrays else "an array"
    return f"{which} does not read back (its data file is damaged or cut short)"
  if isinstance(error, json.JSONDecodeError):
    return f"a metadata file is not valid JSON ({error})"
  lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
  return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _silence_abandoned_orbax_reads() -> None:
  """A restore that fails part-way leaves orbax's other reads behind. They fail again later,
  in orbax's event-loop thread, and each prints a TensorStore spec hundreds of lines long:
  coroutines "ignored" when collected, tasks and gathering futures whose "exception was never
  retrieved", callbacks onto the closed loop. The failure itself is reported in one line
  (`_reason`), so for the rest of the process those echoes are dropped; every other error
  still prints.

  Installed before the first restore, not after a failure: an abandoned read can fail on
  orbax's closed loop before the restore's exception reaches the caller."""
  import logging
  import traceback

  previous = sys.unraisablehook
  if getattr(previous, "drops_orbax_echoes", False):
    return

  def from_orbax(text: str) -> bool:
    return "orbax" in text or "Event loop is closed" in text

  def hook(unraisable):
    code = getattr(unraisable.object, "cr_code", None)
    where = code.co_filename if code else ""
    text = "".join(traceback.format_exception(unraisable.exc_value))
    if not from_orbax(where + text):
      previous(unraisable)

  def keep(record: logging.LogRecord) -> bool:
    # "Task exception ..." names the task's coroutine and where it is defined; for a
    # "_GatheringFuture exception ..." only the traceback says where it came from.
    message = record.getMessage()
    if "exception was never retrieved" not in message:
      return True
    if record.exc_info and record.exc_info[1] is not None:
      message += "".join(traceback.format_exception(record.exc_info[1]))
    return not from_orbax(message)

  hook.drops_orbax_echoes = True
  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(keep)


def set_aside(manager, step: int, main: bool = True) -> None:
  """Takes a damaged step out of the manager's view, keeping its files where possible."""
  from jax.experimental import multihost_utils

  if main:
    directory = manager.directory / str(step)
    if "://" in str(directory):
      manager.delete(step)
    else:
      aside = manager.directory.parent / "checkpoints_damaged"
      aside.mkdir(parents=True, exist_ok=True)
      target = aside / str(step)
      suffix = 1
      while target.exists():
        target, suffix = aside / f"{step}.{suffix}", suffix + 1
      shutil.move(str(directory), str(target))
  multihost_utils.sync_global_devices(f"pspec_jax set aside checkpoint {step}")
  manager.reload()


def restore_newest(manager, abstract_state, *, main: bool = True) -> Restored:
  """The newest checkpoint of `manager` that restores completely, with finite numbers.

  Args:
    manager: the run's `orbax.checkpoint.CheckpointManager` (items `state` and `meta`).
    abstract_state: the state's shapes and shardings (`sharding.abstract`).
    main: this is process 0 (the one that moves damaged checkpoints aside).

  Returns:
    What was restored (state None when no checkpoint did) and why each newer one was skipped.
  """
  import jax
  import orbax.checkpoint as ocp

  from train import step as step_lib

  skipped, damaged = [], []
  steps = sorted(manager.all_steps(), reverse=True)
  if steps:
    _silence_abandoned_orbax_reads()
  for step in steps:
    try:
      restored = manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          meta=ocp.args.JsonRestore(),
        ),
      )
      meta = restored.meta
      if not isinstance(meta, dict) or "data_position" not in meta:
        raise ValueError(f"its metadata {meta!r} has no data_position")
      if not bool(jax.device_get(step_lib.all_finite(restored.state.params))):
        raise ValueError("its weights hold NaN or Inf")
    except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint back is damage
      skipped.append(f"step {step}: {_reason(e)}")
      damaged.append(step)
      continue
    # Only once an older checkpoint has restored are the newer ones set aside: when none
    # restores (a config that no longer matches the run, say), nothing is moved.
    for bad in damaged:
      set_aside(manager, bad, main)
    return Restored(state=restored.state, meta=meta, step=step, skipped=skipped)
  if skipped:
    raise ValueError(
      f"no checkpoint in {manager.directory} restores ({'; '.join(skipped)}): if the config "
      "changed since they were written, restore it; to start afresh, move that directory away"
    )
  return Restored(state=None, meta=None, step=None, skipped=skipped)
