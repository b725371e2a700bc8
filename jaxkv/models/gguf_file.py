"""A fast GGUF reader: metadata as plain Python values, tensors as memory-mapped bytes.

`gguf.GGUFReader` builds a numpy view per metadata element; on a tokenizer's
49k-151k vocabulary and merge strings that takes 8-30 s per file on a small CPU,
and jaxkv used to read each file twice (weights and tokenizer). This reader
parses the same format (GGUF v2/v3, little-endian) with `struct` in well under a
second and leaves tensor data in an `np.memmap`; dequantization still goes
through `gguf.quants.dequantize`, the reference implementation.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF",
version u32, tensor_count u64, kv_count u64; kv pairs (string key, u32 type,
value); tensor infos (string name, u32 n_dims, u64 dims[n_dims] innermost
first, u32 ggml type, u64 offset); padding to `general.alignment` (32); data.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import struct

import gguf
import numpy as np

_MAGIC = b"GGUF"
# GGUFValueType -> struct format of one scalar
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor: `shape` in numpy order (outermost first), ggml type, raw bytes."""
  name: str
  shape: tuple[int, ...]
  ggml_type: int
  data: np.ndarray  # uint8 view into the file

  def dequantize(self) -> np.ndarray:
    """float32 array of `shape` (any type `gguf.quants.dequantize` knows, F32/F16 included)."""
    arr = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.ggml_type))
    return np.asarray(arr, np.float32).reshape(self.shape)


class _Cursor:
  __slots__ = ("buf", "path", "pos")

  def __init__(self, buf, path):
    self.buf, self.pos, self.path = buf, 0, path

  def unpack(self, fmt: str):
    try:
      out = struct.unpack_from("<" + fmt, self.buf, self.pos)
    except struct.error as e:
      raise ValueError(f"{self.path}: truncated GGUF at byte {self.pos}") from e
    self.pos += struct.calcsize("<" + fmt)
    return out

  def string(self) -> str:
    (n,) = self.unpack("Q")
    if self.pos + n > len(self.buf):
      raise ValueError(f"{self.path}: string of {n} bytes runs past the end of the file")
    s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
    self.pos += n
    return s

  def value(self, vtype: int):
    if vtype == _STRING:
      return self.string()
    if vtype == _ARRAY:
      etype, n = self.unpack("IQ")
      if etype == _STRING:
        return [self.string() for _ in range(n)]
      if etype in _NUMPY:
        dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
        arr = np.frombuffer(self.buf, dt, count=n, offset=self.pos)
        self.pos += arr.nbytes
        return arr.tolist()
      if etype == _ARRAY:
        return [self.value(_ARRAY) for _ in range(n)]
      raise ValueError(f"{self.path}: unknown GGUF array element type {etype}")
    if vtype in _SCALAR:
      return self.unpack(_SCALAR[vtype])[0]
    raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


@dataclasses.dataclass(frozen=True)
class GGUFFile:
  """A parsed GGUF file: `metadata` {key: value} and `tensors` {name: TensorInfo}."""
  path: str
  version: int
  metadata: dict
  tensors: dict[str, TensorInfo]

  def get(self, key: str, default=None):
    return self.metadata.get(key, default)


def read(path: str | os.PathLike) -> GGUFFile:
  """Parses a GGUF file (cached on path, size and mtime); tensor data stays mapped.

  Raises:
    FileNotFoundError: no such file.
    ValueError: not a GGUF file, an unsupported version, or a truncated file.
  """
  p = pathlib.Path(path).expanduser().resolve()
  if not p.is_file():
    raise FileNotFoundError(f"GGUF file not found: {p}")
  st = p.stat()
  return _read(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: str, size: int, mtime_ns: int) -> GGUFFile:
  del mtime_ns  # part of the cache key only
  if size < 24:
    raise ValueError(f"{path} is not a GGUF file ({size} bytes)")
  buf = np.memmap(path, dtype=np.uint8, mode="r")
  cur = _Cursor(memoryview(buf), path)
  if bytes(buf[:4]) != _MAGIC:
    raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
  cur.pos = 4
  version, n_tensors, n_kv = cur.unpack("IQQ")
  if version not in (2, 3):
    raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
  metadata = {}
  for _ in range(n_kv):
    key = cur.string()
    (vtype,) = cur.unpack("I")
    metadata[key] = cur.value(vtype)
  infos = []
  for _ in range(n_tensors):
    name = cur.string()
    (n_dims,) = cur.unpack("I")
    dims = cur.unpack("Q" * n_dims)
    ggml_type, offset = cur.unpack("IQ")
    infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
  align = int(metadata.get("general.alignment", 32))
  data_start = -(-cur.pos // align) * align
  out = {}
  for name, shape, ggml_type, offset in infos:
    try:
      block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError) as e:
      raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from e
    nbytes = int(np.prod(shape)) // block * type_size
    start = data_start + offset
    if start + nbytes > size:
      raise ValueError(f"{path}: tensor {name!r} runs past the end of the file "
                       f"(truncated download?)")
    out[name] = TensorInfo(name, shape, ggml_type, buf[start:start + nbytes])
  return GGUFFile(path, version, metadata, out)
