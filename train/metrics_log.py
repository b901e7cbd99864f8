"""Training metrics: one JSON line per log step, and TensorBoard event files.

The workdir may be local or a URL such as gs://bucket/run (through `etils.epath`; TensorBoard
files on GCS need the `google-cloud-storage` package, which the `tpu` extra installs).
"""

import json

from etils import epath


class MetricsLog:
  """Writes `metrics.jsonl` and TensorBoard scalars under the workdir; inactive on hosts > 0."""

  def __init__(self, workdir: str, active: bool = True):
    self.active = active
    if not active:
      return
    from tensorboardX import SummaryWriter

    directory = epath.Path(workdir)
    directory.mkdir(parents=True, exist_ok=True)
    self._path = directory / "metrics.jsonl"
    # Object stores cannot append: the whole file is rewritten (it is small) on every write.
    self._text = self._path.read_text() if self._path.exists() else ""
    self._tb = SummaryWriter(str(directory / "tb"))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.active:
      return
    self._text += json.dumps({"step": step} | scalars) + "\n"
    partial = self._path.parent / (self._path.name + ".partial")
    partial.write_text(self._text)
    partial.replace(self._path)  # a run killed mid-write keeps the previous file
    for name, value in scalars.items():
      self._tb.add_scalar(name, value, step)
    self._tb.flush()

  def text(self, name: str, text: str) -> None:
    if self.active:
      self._tb.add_text(name, text)

  def close(self) -> None:
    if self.active:
      self._tb.close()
