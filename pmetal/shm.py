"""Shared-memory hand-off of large arrays between processes of one machine.

The sender writes the array into a fresh POSIX shared-memory object
(``/pmetal-<pid>-<n>-<random>``, mode 0600) and sends only its name; the
receiver maps it, unlinks the name at once (so nothing is left behind once
the array is garbage-collected) and wraps the mapping as a read-only array
without copying. One copy in all, against two through a socket, and no
authentication pass: the bytes never leave the machine, and the name travels
in an authenticated message.

Only peers that proved in the handshake that they run on the same host use
this path (see :func:`host_id`).
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import socket
import sys
import uuid
from functools import lru_cache
from typing import Any

from pmetal.errors import ProtocolError

__all__ = ["attach", "export", "host_id", "unlink"]

try:
    import _posixshmem
except ImportError:  # Windows: no POSIX shared memory; arrays go through sockets
    _posixshmem = None

_counter = itertools.count()
_WRITE = 8 << 20


@lru_cache(maxsize=1)
def host_id() -> bytes:
    """16 bytes naming this machine and boot: equal for two processes exactly
    when they share a kernel (and so /dev/shm), network namespaces included."""
    parts = [socket.gethostname().encode(), uuid.getnode().to_bytes(8, "little")]
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path, "rb") as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    return hashlib.blake2b(b"\0".join(parts), digest_size=16).digest()


def available() -> bool:
    return _posixshmem is not None


def export(view: memoryview) -> str:
    """Copy ``view`` (bytes) into a new shared-memory object; return its name."""
    assert _posixshmem is not None
    name = f"/pmetal-{os.getpid()}-{next(_counter)}-{os.urandom(4).hex()}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, len(view))
        if sys.platform == "linux":
            # pwrite fills tmpfs pages without a page fault per page: about
            # twice as fast as writing through a fresh mapping here.
            off = 0
            while off < len(view):
                off += os.pwrite(fd, view[off:off + _WRITE], off)
        elif len(view):
            # macOS shared-memory objects can only be written through a mapping.
            with mmap.mmap(fd, len(view)) as mapping:
                mapping[:] = view
    except BaseException:
        _posixshmem.shm_unlink(name)
        raise
    finally:
        os.close(fd)
    return name


def attach(name: str, nbytes: int) -> Any:
    """Map the object ``name`` (of ``nbytes`` bytes) read-only and unlink it."""
    if _posixshmem is None:
        raise ProtocolError("received a shared-memory array on a platform without POSIX "
                            "shared memory")
    if not name.startswith("/pmetal-") or "/" in name[1:] or len(name) > 64:
        raise ProtocolError(f"bad shared-memory name {name!r}")
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, 0o600)
    except OSError as exc:
        raise ProtocolError(f"shared-memory array {name} is gone: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ProtocolError(f"shared-memory array {name} holds {size} bytes, the message "
                                f"says {nbytes}")
        mapping = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) if nbytes else b""
    finally:
        os.close(fd)
        unlink(name)
    return mapping


def exists(name: str) -> bool:
    """Whether the object ``name`` is still there (its receiver unlinks it
    once it has mapped it)."""
    if _posixshmem is None:
        return False
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, 0o600)
    except FileNotFoundError:
        return False
    except OSError:
        return True   # there, but not ours to open
    os.close(fd)
    return True


def unlink(name: str) -> None:
    """Remove ``name`` if it still exists (the receiver normally does)."""
    if _posixshmem is None:
        return
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


class SlotPool:
    """Reusable shared-memory slots for the requests one channel sends.

    A fresh object costs a page allocation per 4 KiB page (about 40 ms for
    64 MiB on these machines); a slot that was used once is already backed
    by memory, so reusing it costs one copy. A slot is busy from the request
    that carries it until that request's reply (the receiver copies the array
    out before it runs the call, so the reply means it is done with the
    slot). A request that is never answered retires its slots (unlinked,
    never reused), since its receiver may still read them.
    """

    def __init__(self, max_free_bytes: int = 128 << 20) -> None:
        self._free: list[tuple[str, int, mmap.mmap]] = []
        self._busy: dict[int, list[tuple[str, int, mmap.mmap]]] = {}
        self._max_free_bytes = max_free_bytes

    def put(self, view: memoryview, corr: int) -> tuple[str, int]:
        """Copy ``view`` into a free slot (or a new one) held for ``corr``."""
        assert _posixshmem is not None
        n = len(view)
        best = None
        for i, (_, size, _) in enumerate(self._free):
            if size >= n and (best is None or size < self._free[best][1]):
                best = i
        if best is not None:
            slot = self._free.pop(best)
        else:
            size = max(n, 1)
            name = f"/pmetal-{os.getpid()}-{next(_counter)}-{os.urandom(4).hex()}"
            fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                slot = (name, size, mmap.mmap(fd, size))
            except BaseException:
                _posixshmem.shm_unlink(name)
                raise
            finally:
                os.close(fd)
        slot[2][:n] = view
        self._busy.setdefault(corr, []).append(slot)
        return slot[0], slot[1]

    def release(self, corr: int) -> None:
        """``corr`` was answered: its slots may be reused."""
        slots = self._busy.pop(corr, None)
        if slots is None:  # the request used no slot (nearly every one)
            return
        self._free.extend(slots)
        while sum(s[1] for s in self._free) > self._max_free_bytes:
            self._drop(self._free.pop(0))

    def retire(self, corr: int) -> None:
        """``corr`` will never be answered: unlink its slots."""
        for slot in self._busy.pop(corr, ()):
            self._drop(slot)

    def close(self) -> None:
        for corr in list(self._busy):
            self.retire(corr)
        while self._free:
            self._drop(self._free.pop())

    @staticmethod
    def _drop(slot: tuple[str, int, mmap.mmap]) -> None:
        slot[2].close()
        unlink(slot[0])


# Receiver side: slots stay mapped between requests (their sender reuses
# them), so the mapping is kept too. Bounded: the least recently used goes.
_mapped: dict[str, mmap.mmap] = {}
_MAX_MAPPED = 32


def read_slot(name: str, size: int, nbytes: int) -> memoryview:
    """The first ``nbytes`` of slot ``name`` (mapped read-only, cached)."""
    if _posixshmem is None:
        raise ProtocolError("received a shared-memory array on a platform without POSIX "
                            "shared memory")
    if not name.startswith("/pmetal-") or "/" in name[1:] or len(name) > 64:
        raise ProtocolError(f"bad shared-memory name {name!r}")
    mapping = _mapped.pop(name, None)
    if mapping is None or len(mapping) != size:
        try:
            fd = _posixshmem.shm_open(name, os.O_RDONLY, 0o600)
        except OSError as exc:
            raise ProtocolError(f"shared-memory slot {name} is gone: {exc}") from exc
        try:
            if os.fstat(fd).st_size != size or nbytes > size:
                raise ProtocolError(f"shared-memory slot {name} does not hold {nbytes} bytes")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    _mapped[name] = mapping
    while len(_mapped) > _MAX_MAPPED:
        _mapped.pop(next(iter(_mapped))).close()
    return memoryview(mapping)[:nbytes]
