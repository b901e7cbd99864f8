"""Resuming from the newest checkpoint that reads back whole and finite (`train.resume`)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from train import resume
from train.step import TrainState


def _state(value):
  noise = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)  # incompressible
  params = {"w": jnp.asarray(noise) + value, "b": jnp.zeros((8,), jnp.float32)}
  return TrainState(
    step=jnp.asarray(int(np.nan_to_num(value)), jnp.int32), params=params, opt_state=()
  )


def _manager(directory):
  return ocp.CheckpointManager(
    directory, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
  )


@pytest.fixture
def run(tmp_path):
  """A workdir with checkpoints at steps 1, 2 and 3 (weights filled with the step; 16 KB, so
  they live in data files, not inline in the manifest)."""
  manager = _manager(tmp_path / "checkpoints")
  for step in (1, 2, 3):
    manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(_state(float(step))),
        meta=ocp.args.JsonSave({"step": step, "data_position": 2 * step}),
      ),
    )
  manager.wait_until_finished()
  manager.close()
  return tmp_path


def _abstract():
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(0.0))


def _truncate(checkpoint):
  files = [p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"]
  biggest = max(files, key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[:20])


def test_the_newest_checkpoint_is_restored(run):
  restored = resume.restore_newest(_manager(run / "checkpoints"), _abstract())
  assert (restored.step, restored.meta["data_position"], restored.skipped) == (3, 6, [])
  np.testing.assert_array_equal(restored.state.params["w"], _state(3.0).params["w"])


def test_damaged_checkpoints_are_skipped_named_and_set_aside(run):
  (run / "checkpoints" / "3" / "meta" / "metadata").write_text("")
  _truncate(run / "checkpoints" / "2")
  manager = _manager(run / "checkpoints")
  restored = resume.restore_newest(manager, _abstract())
  assert restored.step == 1 and restored.meta["data_position"] == 2
  np.testing.assert_array_equal(restored.state.params["w"], _state(1.0).params["w"])
  (three, two) = restored.skipped
  assert three.startswith("step 3: a metadata file is not valid JSON")
  assert two.startswith("step 2: the array params.") and "does not read back" in two
  # Out of the manager's way (the run saves steps 2 and 3 again), kept for a look.
  assert manager.all_steps() == [1]
  assert sorted(os.listdir(run / "checkpoints_damaged")) == ["2", "3"]


def test_a_checkpoint_with_non_finite_weights_is_skipped(run):
  manager = _manager(run / "checkpoints")
  manager.save(
    4,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(_state(float("nan"))),
      meta=ocp.args.JsonSave({"step": 4, "data_position": 8}),
    ),
  )
  manager.wait_until_finished()
  restored = resume.restore_newest(manager, _abstract())
  assert restored.step == 3 and restored.skipped == [
    "step 4: ValueError: its weights hold NaN or Inf"
  ]


def test_when_no_checkpoint_restores_nothing_is_moved(run):
  for step in (1, 2, 3):
    (run / "checkpoints" / str(step) / "meta" / "metadata").write_text("")
  manager = _manager(run / "checkpoints")
  with pytest.raises(ValueError, match=r"no checkpoint in .* restores \(step 3: .*step 1: .*move"):
    resume.restore_newest(manager, _abstract())
  assert manager.all_steps() == [1, 2, 3] and not (run / "checkpoints_damaged").exists()


def test_an_empty_workdir_restores_nothing(tmp_path):
  restored = resume.restore_newest(_manager(tmp_path / "checkpoints"), _abstract())
  assert (restored.state, restored.step, restored.skipped) == (None, None, [])


def _raised_in(filename: str) -> Exception:
  """An exception whose traceback runs through a file named `filename`."""
  namespace = {}
  exec(
    compile("def fail():\n  raise ValueError('OUT_OF_RANGE: a read')\n", filename, "exec"),
    namespace,
  )
  try:
    namespace["fail"]()
  except ValueError as e:
    return e


@pytest.mark.parametrize("what", ["Task", "_GatheringFuture"])
def test_abandoned_orbax_reads_are_not_echoed_but_other_errors_are(what, caplog):
  """After a failed restore, orbax's abandoned reads fail again in its event-loop thread and
  asyncio logs each one ("... exception was never retrieved") with a TensorStore spec
  hundreds of lines long. Those are dropped; the same message from anywhere else still
  prints."""
  import logging

  resume._silence_abandoned_orbax_reads()
  log = logging.getLogger("asyncio")
  message = f"{what} exception was never retrieved\nfuture: <{what} finished exception=...>"
  for filename in ("site-packages/orbax/checkpoint/_src/serialization.py", "my_program.py"):
    error = _raised_in(filename)
    log.error(message, exc_info=(type(error), error, error.__traceback__))
  assert len(caplog.records) == 1
  assert "my_program.py" in caplog.text and "orbax" not in caplog.text
