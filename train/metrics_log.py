"""Training metrics: one JSON line per log step, and TensorBoard event files."""

import json
import os


class MetricsLog:
  """Writes `metrics.jsonl` and TensorBoard scalars under the workdir; inactive on hosts > 0."""

  def __init__(self, workdir: str, active: bool = True):
    self.active = active
    if not active:
      return
    from tensorboardX import SummaryWriter

    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
    self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.active:
      return
    self._jsonl.write(json.dumps({"step": step} | scalars) + "\n")
    self._jsonl.flush()
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    self._tb.flush()

  def text(self, name: str, text: str) -> None:
    if self.active:
      self._tb.add_text(name, text)

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._tb.close()
