"""The pieces of models a node holds: ``$PMETAL_HOME/models/<sha256>/``.

One folder per model, named by the sha256 of its file::

    <sha256>/manifest.json   the manifest (pmetal.store.manifest), written atomically
    <sha256>/<file name>     the file at its full size, sparse: only the pieces
                             held have their bytes, the rest reads as zeros
    <sha256>/held            one byte per piece, 1 once the piece's bytes are
                             in the file, checked and on disk
    <sha256>/lock            byte-range locks: one byte per piece

The loaders open ``<file name>`` as they open any GGUF file and read only
their own tensors, so a stage needs only the pieces of its layers.

Writing a piece: take its lock, write its bytes, check their sha256, fsync
the file, then set its byte in ``held`` and fsync that. A crash in between
leaves the piece not held (it is fetched again); bytes that failed their
check are overwritten with zeros before the lock is released, so they are
never read. Several processes of one machine (the stages of a local
pipeline, ``pmetal models pull``) share a folder: a process that finds a
piece's lock taken leaves it to the holder and waits for it at the end
(while the holder makes progress: a stopped holder is an error, not a hang).
The locks are POSIX record locks on one descriptor per folder and process
(closing another descriptor of ``lock`` would drop them).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pmetal.store.errors import ChecksumError, ModelError, ModelFormatError
from pmetal.store.manifest import Manifest, Piece, file_sha256

__all__ = ["ModelFolder", "PieceStore", "StoredModelInfo"]

_MANIFEST, _HELD, _LOCK = "manifest.json", "held", "lock"
_writers: dict[str, threading.Lock] = {}   # folder -> this process's writer lock
_ZEROS = bytes(1 << 20)


@dataclass(frozen=True)
class StoredModelInfo:
    """One stored model as ``pmetal models list`` shows it."""

    sha256: str
    filename: str
    size: int
    held_bytes: int
    pieces: int
    held_pieces: int
    path: Path

    @property
    def complete(self) -> bool:
        return self.held_pieces == self.pieces


def is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


class ModelFolder:
    """One model's folder (see the module docstring)."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder = folder
        self.manifest = manifest
        self.path = folder / manifest.filename
        self._lock_fd: int | None = None

    # ------------------------------------------------------------ reading

    def held(self) -> bytes:
        """One byte per piece, 1 when held."""
        try:
            data = (self.folder / _HELD).read_bytes()
        except FileNotFoundError:
            data = b""
        n = len(self.manifest.pieces)
        return (data + bytes(n))[:n]

    def held_bytes(self, held: bytes | None = None) -> int:
        held = self.held() if held is None else held
        return sum(p.length for p, h in zip(self.manifest.pieces, held) if h)

    def holds(self, pieces: Iterable[Piece]) -> bool:
        held = self.held()
        return all(held[p.index] for p in pieces)

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the file, all of which must
        lie in held pieces (else :class:`ModelError`: a sparse file's holes
        are not the model's bytes)."""
        m = self.manifest
        if offset < 0 or length < 1 or offset + length > m.size:
            raise ModelError(f"bytes {offset}..{offset + length} are outside {m.filename} "
                             f"({m.size} bytes)")
        held = self.held()
        missing = [m.pieces[i].name for i in m.covering(offset, length) if not held[i]]
        if missing:
            raise ModelError(f"this node does not hold {', '.join(missing[:3])} of "
                             f"{m.filename} (sha256 {m.sha256[:12]})")
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def info(self) -> StoredModelInfo:
        held = self.held()
        m = self.manifest
        return StoredModelInfo(m.sha256, m.filename, m.size, self.held_bytes(held),
                               len(m.pieces), sum(1 for h in held if h), self.path)

    # ------------------------------------------------------------ writing

    def _lock_file(self) -> int:
        if self._lock_fd is None:
            self._lock_fd = os.open(self.folder / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        return self._lock_fd

    def try_lock(self, piece: Piece) -> bool:
        """Take ``piece``'s lock if no other process holds it."""
        try:
            fcntl.lockf(self._lock_file(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, piece.index)
        except OSError:
            return False
        return True

    def lock(self, piece: Piece, stall: float) -> None:
        """Wait for ``piece``'s lock while its holder, another process of
        this machine, makes progress (the file's blocks or the held pieces
        change); after ``stall`` s without any, raise :class:`ModelError`
        (the holder is stopped or stuck: nothing waits on it forever)."""
        progress, since, pause = self._progress(), time.monotonic(), 0.005
        while not self.try_lock(piece):
            now = time.monotonic()
            seen = self._progress()
            if seen != progress:
                progress, since = seen, now
            elif now - since > stall:
                raise ModelError(
                    f"piece {piece.index} ({piece.name}) of model {self.manifest.sha256[:12]} "
                    f"is being written by another process of this machine, which made no "
                    f"progress for {stall:g} s (stopped or stuck?); end that process (a stage "
                    f"or 'pmetal models pull' of this model) and try again")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _progress(self) -> tuple[int, bytes]:
        """What a writer of this folder changes as it goes."""
        try:
            blocks = os.stat(self.path).st_blocks
        except OSError:
            blocks = -1
        return blocks, bytes(self.held())

    def unlock(self, piece: Piece) -> None:
        fcntl.lockf(self._lock_file(), fcntl.LOCK_UN, 1, piece.index)

    @contextlib.contextmanager
    def writer(self) -> Iterator[int]:
        """A descriptor of the file open for writing (one puller at a time
        per process and model: the record locks are the process's, so two
        threads would not keep each other off a piece)."""
        with _writers.setdefault(str(self.folder), threading.Lock()):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                yield fd
            finally:
                os.close(fd)

    def commit(self, fd: int, pieces: Iterable[Piece]) -> None:
        """Mark ``pieces`` (whose bytes are written and checked) held, after
        the file's bytes reach the disk."""
        pieces = list(pieces)
        if not pieces:
            return
        os.fsync(fd)
        held_fd = os.open(self.folder / _HELD, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for piece in pieces:
                os.pwrite(held_fd, b"\x01", piece.index)
            os.fsync(held_fd)
        finally:
            os.close(held_fd)

    def erase(self, fd: int, piece: Piece, upto: int | None = None) -> None:
        """Overwrite ``piece``'s bytes (up to ``upto``) with zeros: bytes that
        failed their check are never left to be read."""
        at, end = piece.offset, piece.end if upto is None else upto
        while at < end:
            at += os.pwrite(fd, _ZEROS[:min(len(_ZEROS), end - at)], at)

    def verify_whole(self) -> None:
        """Once every piece is held: the file's sha256 must be the model's
        (pieces that each match a wrong manifest would not); on a mismatch
        the folder is removed."""
        digest = file_sha256(self.path)
        if digest != self.manifest.sha256:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise ChecksumError(
                f"every piece of {self.manifest.filename} matched its manifest, but the whole "
                f"file has sha256 {digest}, not {self.manifest.sha256}: the manifest was "
                "wrong; the copy was removed")

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class PieceStore:
    """The folders of ``root`` (default ``$PMETAL_HOME/models``), one per model."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._open: dict[str, ModelFolder] = {}

    def folder_of(self, sha256: str) -> Path:
        if not is_sha256(sha256):
            raise ModelFormatError(f"{sha256!r} is not a sha256 (64 lowercase hex digits)")
        return self.root / sha256

    def open(self, sha256: str) -> ModelFolder | None:
        """The folder of model ``sha256``, or None when nothing of it is stored."""
        folder = self.folder_of(sha256)
        cached = self._open.get(sha256)
        if cached is not None and (folder / _MANIFEST).is_file():
            return cached
        try:
            data = (folder / _MANIFEST).read_bytes()
        except FileNotFoundError:
            return None
        manifest = Manifest.decode(data, sha256=sha256)
        self._open[sha256] = ModelFolder(folder, manifest)
        return self._open[sha256]

    def create(self, manifest: Manifest) -> ModelFolder:
        """The folder for ``manifest``'s model, made if needed: the manifest,
        a sparse file of the full size and an empty ``held``."""
        existing = self.open(manifest.sha256)
        if existing is not None:
            return existing
        folder = self.folder_of(manifest.sha256)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / manifest.filename, "ab") as f:
            if os.fstat(f.fileno()).st_size != manifest.size:
                os.truncate(f.fileno(), manifest.size)
        _write_atomically(folder / _MANIFEST, manifest.encode())
        return self.open(manifest.sha256)  # type: ignore[return-value]

    def add_file(self, path: Path, manifest: Manifest) -> ModelFolder:
        """Store the whole file at ``path`` (its manifest built from it, so
        checked) as model ``manifest.sha256``: a hard link when the file is
        on the store's filesystem, else a copy."""
        folder = self.folder_of(manifest.sha256)
        entry = self.open(manifest.sha256)
        if entry is not None and entry.info().complete:
            return entry
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / manifest.filename
        staged = folder / f".add-{os.getpid()}"
        try:
            try:
                os.link(path, staged)
            except OSError:
                shutil.copyfile(path, staged)
            os.replace(staged, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                staged.unlink()
        _write_atomically(folder / _HELD, b"\x01" * len(manifest.pieces))
        _write_atomically(folder / _MANIFEST, manifest.encode())
        self._open.pop(manifest.sha256, None)
        return self.open(manifest.sha256)  # type: ignore[return-value]

    def list(self) -> list[StoredModelInfo]:
        out = []
        if self.root.is_dir():
            for folder in sorted(self.root.iterdir()):
                if folder.is_dir() and is_sha256(folder.name):
                    try:
                        entry = self.open(folder.name)
                    except ModelFormatError:
                        continue
                    if entry is not None:
                        out.append(entry.info())
        return out

    def remove(self, sha256: str) -> bool:
        """Delete model ``sha256``'s folder; False when it was not there.
        A stage that has the file open keeps reading it until it closes."""
        folder = self.folder_of(sha256)
        entry = self._open.pop(sha256, None)
        if entry is not None:
            entry.close()
        if not folder.exists():
            return False
        shutil.rmtree(folder)
        return True


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
