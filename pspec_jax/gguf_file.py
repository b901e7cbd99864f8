"""A GGUF file's metadata and memory-mapped tensors, read in milliseconds.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, which for a
tokenizer's 100k strings takes seconds at each program start. This reads the same header with
`struct` (GGUF versions 2 and 3, little-endian) and leaves dequantisation to `gguf.quants`.
"""

import dataclasses
import math
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFFile", "Tensor"]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's
MAX_NESTING = 8  # arrays of arrays of ...: deeper than any writer goes
# Metadata value types: the struct format of each scalar; 8 is a string, 9 an array.
_SCALARS = {
  0: "B",
  1: "b",
  2: "H",
  3: "h",
  4: "I",
  5: "i",
  6: "f",
  7: "?",
  10: "Q",
  11: "q",
  12: "d",
}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers; every other type is read as raw bytes.
_PLAIN = {
  GGMLQuantizationType.F32: np.float32,
  GGMLQuantizationType.F16: np.float16,
  GGMLQuantizationType.F64: np.float64,
  GGMLQuantizationType.I8: np.int8,
  GGMLQuantizationType.I16: np.int16,
  GGMLQuantizationType.I32: np.int32,
  GGMLQuantizationType.I64: np.int64,
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of the file, its data a read-only view of the memory map."""

  name: str
  shape: tuple[int, ...]  # as GGUF lists dims: innermost first
  tensor_type: GGMLQuantizationType
  data: np.ndarray  # plain types: their values, outermost dim first; others: raw bytes


class GGUFFile:
  """A GGUF file (version 2 or 3, little-endian) opened for reading: its metadata as `fields`
  (key -> int, float, bool, str or list) and its `tensors` in file order. A file that is not
  one, is cut short or is inconsistent raises ValueError.
  """

  def __init__(self, path: str):
    self._buf = np.memmap(path, mode="r")
    self._mv = memoryview(self._buf)
    self._offset = 0
    try:
      if bytes(self._mv[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
      self._offset = 4
      (version,) = self._read("I")
      if version & 0xFFFF == 0:
        raise ValueError("big-endian GGUF files are not supported")
      if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (2 and 3 are read)")
      num_tensors, num_fields = self._read("QQ")
      self.fields: dict[str, Any] = {}
      for _ in range(num_fields):
        key = self._string()
        (kind,) = self._read("I")
        if key in self.fields:
          raise ValueError(f"metadata key {key!r} appears twice")
        self.fields[key] = self._value(kind)
      infos = [self._tensor_info() for _ in range(num_tensors)]
      if len({info[0] for info in infos}) < len(infos):
        raise ValueError("a tensor name appears twice")
      alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
      if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"bad general.alignment {alignment!r}")
      start = -(-self._offset // alignment) * alignment
      self.tensors = [self._tensor(start, *info) for info in infos]
    except (struct.error, UnicodeDecodeError) as e:
      raise ValueError(f"truncated or corrupt header ({e})") from None

  def _read(self, fmt: str) -> tuple:
    values = struct.unpack_from("<" + fmt, self._mv, self._offset)
    self._offset += struct.calcsize("<" + fmt)
    return values

  def _string(self) -> str:
    (n,) = self._read("Q")
    end = self._offset + n
    if end > len(self._mv):
      raise ValueError("truncated or corrupt header (a string runs past the end)")
    text = str(self._mv[self._offset : end], "utf-8")
    self._offset = end
    return text

  def _value(self, kind: int, depth: int = 0) -> Any:
    if kind in _SCALARS:
      return self._read(_SCALARS[kind])[0]
    if kind == _STRING:
      return self._string()
    if kind != _ARRAY:
      raise ValueError(f"unknown GGUF metadata type {kind}")
    item_kind, n = self._read("IQ")
    if item_kind in _SCALARS:
      return list(self._read(f"{n}{_SCALARS[item_kind]}")) if n else []
    if depth >= MAX_NESTING:
      raise ValueError(f"metadata arrays nested deeper than {MAX_NESTING}")
    return [self._value(item_kind, depth + 1) for _ in range(n)]

  def _tensor_info(self) -> tuple:
    name = self._string()
    (num_dims,) = self._read("I")
    if not 1 <= num_dims <= MAX_DIMS:
      raise ValueError(f"tensor {name} has {num_dims} dimensions (1 to {MAX_DIMS} are read)")
    shape = self._read(f"{num_dims}Q")
    kind, offset = self._read("IQ")
    try:
      kind = GGMLQuantizationType(kind)
    except ValueError:
      raise ValueError(f"tensor {name} has unknown type {kind}") from None
    return name, shape, kind, offset

  def _tensor(self, start: int, name, shape, kind, offset) -> Tensor:
    block, type_size = GGML_QUANT_SIZES[kind]
    count = math.prod(shape)
    num_bytes = count * type_size // block
    begin = start + offset
    if begin + num_bytes > len(self._buf):
      raise ValueError(f"tensor {name} runs past the end of the file")
    raw = self._buf[begin : begin + num_bytes]
    dims = tuple(reversed(shape))
    if kind in _PLAIN:
      data = raw.view(_PLAIN[kind]).reshape(dims)
    else:
      data = raw.reshape(quant_shape_to_byte_shape(dims, kind))
    return Tensor(name, tuple(shape), kind, data)
