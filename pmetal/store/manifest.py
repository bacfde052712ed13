"""A model file cut into pieces, each pinned by its sha256: the manifest.

A GGUF file is a header (metadata, the tokenizer, the tensor table) and then
its tensors. The manifest cuts the whole file into consecutive *pieces*:
piece 0 is the header (bytes 0 up to the first tensor) and each tensor is
one piece, running from its offset to the next tensor's (its alignment
padding included), so that the pieces cover every byte once and a node that
holds them all holds the file, which its whole-file sha256 then checks.

A manifest is built once, by a node that holds the whole file and checked
it, in one pass over the file. Its bytes are canonical (sorted keys, no
spaces, no dates), so every node that builds the manifest of one file gets
the same bytes and the same :attr:`Manifest.digest`: a driver names a
model by the file's sha256 and passes the manifest's digest along, and a
stage checks the manifest a member sends it against that digest before it
trusts a single per-piece hash in it.

Decoding a manifest (from disk or from a member) checks everything a
store relies on: a known format version, a plain file name, pieces that
tile ``[0, size)`` in order, lowercase hex digests, at most
:data:`MAX_PIECES` pieces.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pmetal.store.errors import ChecksumError, ModelFormatError

__all__ = ["HEADER", "MANIFEST_VERSION", "MAX_PIECES", "Manifest", "Piece", "build_manifest",
           "file_sha256"]

MANIFEST_VERSION = 1
HEADER = "<header>"
"""The name of piece 0: the GGUF header, up to the first tensor."""
MAX_PIECES = 1 << 16
"""Most pieces a manifest may list (a 405B model has about 1,100 tensors)."""

_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of the file, with their sha256."""

    index: int
    name: str
    offset: int
    length: int
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Manifest:
    """The pieces of one model file (see the module docstring)."""

    filename: str
    size: int
    sha256: str
    pieces: tuple[Piece, ...]

    def encode(self) -> bytes:
        """The canonical bytes (identical on every node for one file)."""
        return json.dumps({
            "format": MANIFEST_VERSION, "filename": self.filename, "size": self.size,
            "sha256": self.sha256,
            "pieces": [[p.name, p.offset, p.length, p.sha256] for p in self.pieces]},
            sort_keys=True, separators=(",", ":")).encode()

    @cached_property
    def digest(self) -> str:
        """sha256 of :meth:`encode`."""
        return hashlib.sha256(self.encode()).hexdigest()

    @cached_property
    def by_name(self) -> dict[str, Piece]:
        return {p.name: p for p in self.pieces}

    def named(self, names: Any) -> list[Piece]:
        """The pieces of ``names`` (the header always first), in file order;
        a name the file does not have is a ModelFormatError."""
        missing = [n for n in names if n not in self.by_name]
        if missing:
            raise ModelFormatError(f"{self.filename} (sha256 {self.sha256[:12]}) has no "
                                   f"tensor {', '.join(sorted(missing)[:3])}")
        return sorted({self.by_name[n] for n in [HEADER, *names]}, key=lambda p: p.index)

    def covering(self, offset: int, length: int) -> range:
        """Indexes of the pieces that bytes ``[offset, offset + length)`` touch."""
        first = _bisect(self.pieces, offset)
        last = _bisect(self.pieces, offset + max(length, 1) - 1)
        return range(first, last + 1)

    @classmethod
    def decode(cls, data: bytes, *, sha256: str | None = None,
               digest: str | None = None) -> Manifest:
        """A manifest from its bytes, checked (see the module docstring);
        ``sha256``: the file it must describe; ``digest``: the bytes'
        sha256 it must have (a manifest from a member)."""
        if digest is not None and hashlib.sha256(data).hexdigest() != digest:
            raise ChecksumError(f"the manifest received has sha256 "
                                f"{hashlib.sha256(data).hexdigest()[:12]}..., not the "
                                f"{digest[:12]}... the driver named; it was refused")
        try:
            raw = json.loads(data)
            if raw.get("format") != MANIFEST_VERSION:
                raise ValueError(f"format {raw.get('format')!r}, not {MANIFEST_VERSION}")
            filename, size, whole = raw["filename"], raw["size"], raw["sha256"]
            entries = raw["pieces"]
            if not (isinstance(filename, str) and filename and "/" not in filename
                    and "\\" not in filename and filename not in (".", "..")
                    and not filename.startswith(".")):
                raise ValueError(f"file name {filename!r} is not a plain file name")
            if type(size) is not int or size < 1:
                raise ValueError(f"size {size!r}")
            if not (isinstance(whole, str) and _HEX.fullmatch(whole)):
                raise ValueError(f"sha256 {whole!r}")
            if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_PIECES:
                raise ValueError("pieces must be a list of 1 to "
                                 f"{MAX_PIECES} entries")
            pieces, at = [], 0
            for index, entry in enumerate(entries):
                name, offset, length, digest_ = entry
                if not (isinstance(name, str) and type(offset) is int and type(length) is int
                        and isinstance(digest_, str) and _HEX.fullmatch(digest_)):
                    raise ValueError(f"piece {index} is malformed")
                if offset != at or length < 1:
                    raise ValueError(f"piece {index} ({name}) does not follow the one before")
                pieces.append(Piece(index, name, offset, length, digest_))
                at += length
            if at != size or pieces[0].name != HEADER:
                raise ValueError("the pieces do not tile the file from its header on")
            if len({p.name for p in pieces}) != len(pieces):
                raise ValueError("two pieces have one name")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFormatError(f"a malformed model manifest: {exc}") from exc
        if sha256 is not None and whole != sha256:
            raise ModelFormatError(f"the manifest describes {whole[:12]}..., not the model "
                                   f"{sha256[:12]}... asked for")
        return cls(filename, size, whole, tuple(pieces))


def _bisect(pieces: tuple[Piece, ...], offset: int) -> int:
    low, high = 0, len(pieces) - 1
    while low < high:
        mid = (low + high + 1) // 2
        if pieces[mid].offset <= offset:
            low = mid
        else:
            high = mid - 1
    return low


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(path: Path, tensors: Mapping[str, int], *, filename: str | None = None,
                   sha256: str | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Manifest:
    """The manifest of the file at ``path`` whose tensors start at the
    absolute offsets ``tensors`` (name -> offset), hashing every piece and
    the whole file in one pass. ``sha256``: what the whole file must hash
    to (refused otherwise). ``progress(done, total)`` gets the bytes read."""
    size = path.stat().st_size
    starts = sorted((offset, name) for name, offset in tensors.items())
    if not starts or starts[0][0] <= 0 or starts[-1][0] >= size or len(starts) + 1 > MAX_PIECES:
        raise ModelFormatError(f"{path}: its tensor table does not describe a model file of "
                               f"{size} bytes")
    bounds = [(HEADER, 0)] + [(name, offset) for offset, name in starts]
    whole = hashlib.sha256()
    pieces = []
    with open(path, "rb") as f:
        for index, (name, offset) in enumerate(bounds):
            end = bounds[index + 1][1] if index + 1 < len(bounds) else size
            digest, left = hashlib.sha256(), end - offset
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk:
                    raise ModelFormatError(f"{path} shrank while its manifest was built")
                digest.update(chunk)
                whole.update(chunk)
                left -= len(chunk)
                if progress is not None:
                    progress(end - left, size)
            pieces.append(Piece(index, name, offset, end - offset, digest.hexdigest()))
    if sha256 is not None and whole.hexdigest() != sha256:
        raise ChecksumError(f"{path} has sha256 {whole.hexdigest()}, not {sha256}")
    return Manifest(filename or path.name, size, whole.hexdigest(), tuple(pieces))
