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
"""

from __future__ import annotations

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

    def take(self, size: int) -> bytes:
        if size < 0 or self.pos + size > len(self.buffer):
            raise ModelFormatError(f"{self.path}: GGUF header is truncated or corrupt "
                                   f"(needs {size} bytes at offset {self.pos})")
        data = self.buffer[self.pos:self.pos + size]
        self.pos += size
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{self.path}: GGUF string at offset {self.pos} "
                                   "is not UTF-8") from exc

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item) for _ in range(count)]
        raise ModelFormatError(f"{self.path}: unknown GGUF value type {kind} at offset "
                               f"{self.pos}")


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
        import gguf  # the quantisation tables; imported here so pmetal stays light

        cur = _Cursor(buffer, self.path)
        if bytes(cur.take(4)) != _MAGIC:
            raise ModelFormatError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelFormatError(
                f"{self.path}: GGUF version {version} is not supported (2 and 3 are; a "
                "big-endian file shows up as a huge version number)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {}
        for name, shape, kind, offset in infos:
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (KeyError, ValueError) as exc:
                raise ModelFormatError(f"{self.path}: tensor {name} has unknown ggml type "
                                       f"{kind}") from exc
            count = int(np.prod(shape, dtype=np.int64))
            if shape and shape[-1] % block:
                raise ModelFormatError(f"{self.path}: tensor {name} rows of {shape[-1]} are "
                                       f"not whole blocks of {block}")
            nbytes = count // block * type_size
            start = data_start + offset
            if start + nbytes > len(buffer):
                raise ModelFormatError(f"{self.path}: tensor {name} runs past the end of the "
                                       "file (truncated download?)")
            tensors[name] = GGUFTensorInfo(name, shape, kind, start, nbytes)
        return metadata, tensors

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to a new float32 C-contiguous array."""
        import gguf

        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path} has no tensor {name!r}")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        kind = gguf.GGMLQuantizationType(info.ggml_type)
        row_bytes = info.nbytes // max(1, int(np.prod(info.shape[:-1], dtype=np.int64)))
        data = raw.reshape(*info.shape[:-1], row_bytes) if info.shape else raw
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16
            array = data.view(dtype).reshape(info.shape)
        else:
            array = gguf.quants.dequantize(data, kind).reshape(info.shape)
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
