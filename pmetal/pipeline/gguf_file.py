"""A GGUF file: its metadata and its tensors, read lazily from a memory map.

What it owns: parsing the GGUF header (format version 2 and 3, little-endian)
and turning one named tensor into a float32 numpy array. Dequantizing is the
``gguf`` package's (``gguf.quants.dequantize``, every llama.cpp block format);
the header is parsed here because ``gguf.GGUFReader`` builds a numpy view per
token string, which for a 49k-token vocabulary takes about 3 s on this
machine where a plain parse takes a fraction of that, and every stage and the
tokenizer open the file.

The tensor bytes stay in the memory map until :meth:`GGUFFile.tensor` asks
for one, so a stage that loads layers 10-19 reads only those pages.

Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic
``GGUF``, u32 version, u64 tensor count, u64 key-value count, the key-values
(string key, u32 value type, value), the tensor infos (string name, u32
dimension count, u64 dimensions innermost first, u32 type, u64 offset), then
the data at the next multiple of ``general.alignment`` (default 32).

Bounds. A GGUF file comes from the internet, so every count and size in its
header is checked against the bytes the file could hold BEFORE anything is
allocated or looped over, with Python integers (no int64 wrap-around), and
anything malformed is one :class:`ModelFormatError` naming the key, tensor or
offset (never ``RecursionError``, ``ZeroDivisionError``, ``OverflowError``
or ``MemoryError``):

* the tensor and key-value counts: each entry takes at least
  :data:`MIN_TENSOR_INFO_BYTES` / :data:`MIN_KV_BYTES` bytes of the header;
* string lengths and array counts: each array element takes at least its
  scalar size (8 bytes for a string, 12 for an array) of what is left;
* arrays nest at most :data:`MAX_ARRAY_NESTING` deep;
* a tensor has 1 to :data:`MAX_DIMS` dimensions, each at least 1 (ggml
  allows empty tensors, no model has one, and a zero dimension would make
  every per-row division by zero), rows of whole quantization blocks, and
  its bytes inside the data region, aligned, overlapping no other tensor;
* ``general.alignment`` is a positive power of two; keys and tensor names
  are unique (llama.cpp refuses duplicates too).

A file cut short says "truncated", with the offset and the file's size.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from pmetal.pipeline.models import ModelFormatError

__all__ = ["GGUFFile", "GGUFTensorInfo"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

MAX_DIMS = 4
"""Most dimensions a tensor may have (``GGML_MAX_DIMS``)."""

MAX_ARRAY_NESTING = 3
"""Most arrays an array value may nest (an array of arrays of arrays). GGUF
files in use hold arrays of scalars or strings (one level); without a bound a
crafted chain of nested arrays recurses until ``RecursionError``."""

MIN_KV_BYTES = 8 + 4 + 1
"""Fewest header bytes one key-value takes: the key's length, its value type
and a one-byte value."""

MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
"""Fewest header bytes one tensor info takes: the name's length, the
dimension count, one dimension, the type and the offset."""

# GGUF value types -> struct format of one scalar (8 = string, 9 = array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives: ``shape`` in numpy order (outermost first, so
    ``(out, in)`` for a projection), ``ggml_type`` a ``GGMLQuantizationType``
    value, ``offset`` and ``nbytes`` into the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class _Cursor:
    """Reads little-endian values from the header, refusing to run past the
    end. Slicing the map copies (bytes), so no view outlives a failed parse
    and keeps the map from closing."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.pos, self.path = buffer, 0, path

    @property
    def left(self) -> int:
        return len(self.buffer) - self.pos

    def take(self, size: int, what: str = "the header") -> bytes:
        if size < 0 or size > self.left:
            raise ModelFormatError(
                f"{self.path}: GGUF header is truncated or corrupt: {what} needs {size} bytes at "
                f"offset {self.pos}, but the file has {len(self.buffer)} bytes")
        data = self.buffer[self.pos:self.pos + size]
        self.pos += size
        return data

    def scalar(self, fmt: str, what: str = "the header") -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        start = self.pos
        raw = self.take(self.scalar("<Q", what), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{self.path}: {what} (GGUF string at offset {start}) "
                                   "is not UTF-8") from exc

    def value(self, kind: int, key: str, depth: int = 0) -> Any:
        what = f"the value of {key}"
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise ModelFormatError(f"{self.path}: {key} has unknown GGUF value type {kind} "
                                   f"(offset {self.pos})")
        if depth >= MAX_ARRAY_NESTING:
            raise ModelFormatError(f"{self.path}: {key} nests arrays more than "
                                   f"{MAX_ARRAY_NESTING} deep")
        item, count = self.scalar("<I", what), self.scalar("<Q", what)
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            return np.frombuffer(self.take(count * dtype.itemsize, what), dtype=dtype).tolist()
        if item not in (_STRING, _ARRAY):
            raise ModelFormatError(f"{self.path}: {key} is an array of unknown GGUF value "
                                   f"type {item} (offset {self.pos})")
        # Checked before the loop: 2**60 empty strings must not loop 2**60 times.
        least = 8 if item == _STRING else 4 + 8
        if count * least > self.left:
            raise ModelFormatError(
                f"{self.path}: GGUF header is truncated or corrupt: {key} claims {count} array "
                f"elements of at least {least} bytes at offset {self.pos}, but the file has "
                f"{len(self.buffer)} bytes")
        return [self.value(item, key, depth + 1) for _ in range(count)]


class GGUFFile:
    """A GGUF file opened read-only. ``metadata`` maps every key to its value
    (arrays as lists); ``tensors`` maps tensor names to their infos.
    :meth:`close` (or ``with``) releases the memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ModelFormatError(f"cannot read GGUF file {self.path}: {exc}") from exc
        try:
            self.metadata, self.tensors = self._parse(self._map)
        except BaseException:
            self._map.close()
            raise

    def _parse(self, buffer: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        cur = _Cursor(buffer, self.path)
        if bytes(cur.take(4)) != _MAGIC:
            raise ModelFormatError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelFormatError(
                f"{self.path}: GGUF version {version} is not supported (2 and 3 are; a "
                "big-endian file shows up as a huge version number)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > cur.left:
            raise ModelFormatError(
                f"{self.path}: GGUF header is truncated or corrupt: it claims {n_kv} "
                f"key-values and {n_tensors} tensors at offset {cur.pos}, more than the file's "
                f"{len(buffer)} bytes can hold")
        metadata: dict[str, Any] = {}
        for index in range(n_kv):
            key = cur.string(f"key-value {index}'s key")
            if key in metadata:
                raise ModelFormatError(f"{self.path}: GGUF key {key} appears twice")
            metadata[key] = cur.value(cur.scalar("<I", f"the type of {key}"), key)
        infos = []
        for index in range(n_tensors):
            name = cur.string(f"tensor {index}'s name")
            infos.append(self._tensor_info(cur, name))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFormatError(f"{self.path}: general.alignment is {alignment!r}, not a "
                                   "positive power of two")
        data_start = -(-cur.pos // alignment) * alignment
        return metadata, self._place(infos, data_start, alignment, len(buffer))

    def _tensor_info(self, cur: _Cursor, name: str) -> tuple[str, tuple[int, ...], int, int]:
        what = f"tensor {name}'s info"
        n_dims = cur.scalar("<I", what)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions; "
                                   f"GGUF tensors have 1 to {MAX_DIMS}")
        dims = tuple(cur.scalar("<Q", what) for _ in range(n_dims))
        if min(dims) < 1:
            raise ModelFormatError(f"{self.path}: tensor {name} has a dimension of 0 "
                                   f"(dimensions {dims}); no model has an empty tensor")
        return name, tuple(reversed(dims)), cur.scalar("<I", what), cur.scalar("<Q", what)

    def _place(self, infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
               alignment: int, size: int) -> dict[str, GGUFTensorInfo]:
        """The tensor infos with their bytes checked to lie inside the data
        region, aligned and apart, sizes computed with Python integers."""
        import gguf  # the quantisation tables; imported here so pmetal stays light

        tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, kind, offset in infos:
            if name in tensors:
                raise ModelFormatError(f"{self.path}: tensor {name} appears twice")
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (KeyError, ValueError) as exc:
                raise ModelFormatError(f"{self.path}: tensor {name} has unknown ggml type "
                                       f"{kind}") from exc
            if shape[-1] % block:
                raise ModelFormatError(f"{self.path}: tensor {name} rows of {shape[-1]} are "
                                       f"not whole blocks of {block}")
            nbytes = math.prod(shape) // block * type_size
            if offset % alignment:
                raise ModelFormatError(f"{self.path}: tensor {name}'s offset {offset} is not "
                                       f"a multiple of general.alignment ({alignment})")
            start = data_start + offset
            if start + nbytes > size:
                raise ModelFormatError(
                    f"{self.path}: tensor {name} runs past the end of the file (truncated "
                    f"download?): shape {shape}, {nbytes} bytes at offset {start}, the file "
                    f"has {size} bytes")
            tensors[name] = GGUFTensorInfo(name, shape, kind, start, nbytes)
        ordered = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
        for before, after in itertools.pairwise(ordered):
            if after.offset < before.offset + before.nbytes:
                raise ModelFormatError(f"{self.path}: tensors {before.name} and {after.name} "
                                       "overlap in the file")
        return tensors

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to a new float32 C-contiguous array."""
        import gguf

        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path} has no tensor {name!r}")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        kind = gguf.GGMLQuantizationType(info.ggml_type)
        # Every dimension is >= 1 (_tensor_info), so there is at least one row.
        data = raw.reshape(*info.shape[:-1], info.nbytes // math.prod(info.shape[:-1]))
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16
            array = data.view(dtype).reshape(info.shape)
        else:
            try:
                array = gguf.quants.dequantize(data, kind).reshape(info.shape)
            except NotImplementedError as exc:
                raise ModelFormatError(f"{self.path}: tensor {name} is {kind.name}, which the "
                                       f"gguf package cannot dequantize: {exc}") from exc
        # A copy even for F32: the result must outlive the memory map.
        return np.array(array, dtype=np.float32, order="C", copy=True)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as stored: a read-only uint8 view of the
        map, no copy (valid while the file is open)."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path} has no tensor {name!r}")
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            # An array still views the map (a traceback holding a frame); the
            # map closes when that array is collected.
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
