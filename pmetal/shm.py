"""Shared-memory hand-off of large arrays between processes of one machine.

The sender writes the array into a fresh POSIX shared-memory object (mode
0600) and sends only its name; the receiver maps it, unlinks the name at once
(so nothing is left behind once the array is garbage-collected) and wraps the
mapping as a read-only array without copying. One copy in all, against two
through a socket, and no authentication pass: the bytes never leave the
machine, and the name travels in an authenticated message.

Names read ``/pm<ns>-<creator>-<reader>-<n>-<random>`` (pids and counter in
base 36, ``ns`` a tag of the creator's pid namespace, ``reader`` 0 when not
known): at most 31 characters, macOS's limit. A process killed with SIGKILL
cannot unlink what it made or was sent; :func:`sweep` unlinks the objects
whose reader is dead (or, with no reader recorded, whose creator is).

Same machine
------------
Only peers that proved in the handshake that they share this machine's
``/dev/shm`` use this path. A MAC address proves nothing (it is random in a
network namespace or container), so the proof is the shared memory itself:
the client creates a small object holding a random secret and names it, with
a hash of the secret, in its Hello (:func:`offer`); a server on the same boot
(:func:`boot_id`) reads the secret, unlinks the object, and answers with a
second hash of it (:func:`answer`); the client checks that hash
(:func:`confirm`). Each side also learns the other's pid (used as the reader
in names) when both share a pid namespace.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import mmap
import os
import re
import socket
import struct
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pmetal.errors import ProtocolError

__all__ = ["READER", "Exports", "HostToken", "Peer", "Reader", "SlotPool", "answer", "attach",
           "boot_id", "confirm", "exists", "export", "objects", "offer", "pid_alive",
           "read_slot", "sweep", "unlink"]

log = logging.getLogger(__name__)

try:
    import _posixshmem
except ImportError:  # Windows: no POSIX shared memory; arrays go through sockets
    _posixshmem = None

_counter = itertools.count()
_WRITE = 8 << 20


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_NAME = re.compile(r"/pm([0-9a-z]{2})-([0-9a-z]{1,6})-([0-9a-z]{1,6})-[0-9a-z]{1,7}-[0-9a-f]{4}")


def _b36(n: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = _DIGITS[d] + out
        if not n:
            return out


@lru_cache(maxsize=1)
def _pid_namespace() -> int:
    """An id of this process's pid namespace (0 where there is none)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _ns_tag() -> str:
    return _b36(1296 + _pid_namespace() % 1296)[-2:]


def _new_name(reader: int) -> str:
    return (f"/pm{_ns_tag()}-{_b36(os.getpid())}-{_b36(reader)}-{_b36(next(_counter))}-"
            f"{os.urandom(2).hex()}")


def _valid_name(name: str) -> bool:
    return (len(name) <= 64 and "/" not in name[1:]
            and (name.startswith("/pmetal-") or _NAME.fullmatch(name) is not None))


@lru_cache(maxsize=1)
def boot_id() -> bytes:
    """16 bytes naming this kernel's current boot (the same in every network
    namespace and container of it): a hint that a peer may share this
    machine, proven by :func:`offer`/:func:`answer`, never trusted alone."""
    raw = b""
    if sys.platform == "linux":
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                raw = f.read().strip()
        except OSError:
            pass
    elif sys.platform == "darwin":
        raw = _darwin_sysctl(b"kern.bootsessionuuid") + _darwin_sysctl(b"kern.boottime")
    if not raw:
        raw = socket.gethostname().encode()
    return hashlib.blake2b(raw, digest_size=16, person=b"pmetal-boot").digest()


def _darwin_sysctl(name: bytes) -> bytes:
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        size = ctypes.c_size_t(256)
        buf = ctypes.create_string_buffer(size.value)
        if libc.sysctlbyname(name, buf, ctypes.byref(size), None, 0) != 0:
            return b""
        return buf.raw[:size.value]
    except (OSError, AttributeError):
        return b""


# ---------------------------------------------------- same-machine proof

_OFFER = struct.Struct("<B16sIQ16s")    # version, boot, pid, pid namespace, H(secret)
_ANSWER = struct.Struct("<B16sIQ16s")   # version, boot, pid, pid namespace, H'(secret)
_HOST_VERSION = 1


@dataclass
class HostToken:
    """The client's side of the same-machine proof: the object it made."""

    name: str
    secret: bytes

    def discard(self) -> None:
        """Unlink the object (the server unlinks it when it reads it)."""
        if self.name:
            unlink(self.name)
            self.name = ""


def _commit(secret: bytes, role: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=16, person=b"pm-shm-" + role).digest()


def offer() -> tuple[bytes, HostToken]:
    """The Hello's ``host`` field and the token behind it. Without POSIX
    shared memory: an empty field (the peer is never taken as local)."""
    if _posixshmem is None:
        return b"", HostToken("", b"")
    secret = os.urandom(32)
    name = _new_name(0)
    try:
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.info("cannot create a shared-memory token (%s): no shared memory this time", exc)
        return b"", HostToken("", b"")
    try:
        os.ftruncate(fd, len(secret))
        with mmap.mmap(fd, len(secret)) as mapping:
            mapping[:] = secret
    except OSError as exc:
        _posixshmem.shm_unlink(name)
        log.info("cannot write a shared-memory token (%s): no shared memory this time", exc)
        return b"", HostToken("", b"")
    finally:
        os.close(fd)
    blob = _OFFER.pack(_HOST_VERSION, boot_id(), os.getpid(), _pid_namespace(),
                       _commit(secret, b"offer")) + name.encode()
    return blob, HostToken(name, secret)


@dataclass(frozen=True)
class Peer:
    """What the same-machine proof established about a peer."""

    local: bool = False
    pid: int = 0
    """The peer's pid when it shares this process's pid namespace, else 0."""


def answer(blob: bytes) -> tuple[bytes, Peer]:
    """Server side: check a Hello's ``host`` field; the Welcome's ``host``
    field and what it proved. The client's object is unlinked once it proved
    to be the token the Hello commits to."""
    if _posixshmem is None or len(blob) <= _OFFER.size:
        return b"", Peer()
    version, boot, pid, pid_ns, commit = _OFFER.unpack_from(blob)
    name = blob[_OFFER.size:].decode(errors="replace")
    if version != _HOST_VERSION or boot != boot_id() or not _NAME.fullmatch(name):
        return b"", Peer()
    secret = _read_token(name)
    if secret is None or not hmac.compare_digest(_commit(secret, b"offer"), commit):
        return b"", Peer()
    unlink(name)   # only now: a Hello must not make us unlink another object
    reply = _ANSWER.pack(_HOST_VERSION, boot_id(), os.getpid(), _pid_namespace(),
                         _commit(secret, b"answer"))
    return reply, Peer(True, pid if pid_ns == _pid_namespace() and pid_ns else 0)


def _read_token(name: str) -> bytes | None:
    assert _posixshmem is not None
    try:
        fd = _posixshmem.shm_open(name, os.O_RDONLY, 0o600)
    except OSError:
        return None   # not on this machine's /dev/shm, or not ours to read
    try:
        if os.fstat(fd).st_size != 32:
            return None
        return os.pread(fd, 32, 0) if hasattr(os, "pread") else os.read(fd, 32)
    except OSError:
        return None
    finally:
        os.close(fd)


def confirm(token: HostToken, blob: bytes) -> Peer:
    """Client side: check the Welcome's ``host`` field against the token;
    the token is discarded."""
    secret = token.secret
    token.discard()
    if not secret or len(blob) != _ANSWER.size:
        return Peer()
    version, boot, pid, pid_ns, proof = _ANSWER.unpack(blob)
    if (version != _HOST_VERSION or boot != boot_id()
            or not hmac.compare_digest(proof, _commit(secret, b"answer"))):
        return Peer()
    return Peer(True, pid if pid_ns == _pid_namespace() and pid_ns else 0)


def available() -> bool:
    return _posixshmem is not None


def export(view: memoryview, reader: int = 0) -> str:
    """Copy ``view`` (bytes) into a new shared-memory object for the process
    ``reader`` (0: not known); return its name."""
    assert _posixshmem is not None
    name = _new_name(reader)
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
    if not _valid_name(name):
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


class Exports(list[str]):
    """The out-of-band writer for one message to a process of this host
    (``codec.encode``'s ``oob``, a ``codec.OutOfBandWriter``): arrays go
    into slots of ``pool`` when one is given (requests), else into one-shot
    objects whose names it collects (the caller unlinks them if the message
    may not have been received). ``reader``: the receiving process's pid."""

    __slots__ = ("pool", "reader")

    def __init__(self, reader: int = 0, pool: SlotPool | None = None) -> None:
        super().__init__()
        self.reader = reader
        self.pool = pool

    def put(self, data: memoryview, corr: int) -> tuple[str, int, bool]:
        if self.pool is not None:
            name, size = self.pool.put(data, corr)
            return name, size, True
        name = export(data, self.reader)
        self.append(name)
        return name, len(data), False


class Reader:
    """The out-of-band reader for messages from processes of this host
    (``codec.decode``'s ``oob``, a ``codec.OutOfBandReader``)."""

    __slots__ = ()

    @staticmethod
    def attach(name: str, nbytes: int) -> Any:
        return attach(name, nbytes)

    @staticmethod
    def read_slot(name: str, size: int, nbytes: int) -> memoryview:
        return read_slot(name, size, nbytes)


READER = Reader()


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` of this pid namespace lives (any user's).

    A zombie (exited, not yet reaped by its parent) is dead: it will never
    read an object again, and its pidfd already said it exited. kill(pid, 0)
    succeeds on a zombie, so Linux's /proc tells the state."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # another user's process: alive unless a zombie
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:   # no /proc (macOS: then kill() said enough), or reaped meanwhile
        return not os.path.isdir("/proc/self")
    # The state follows the command name in parentheses, which may hold spaces.
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] != b"Z"


def objects(*, creators: tuple[int, ...] = (), readers: tuple[int, ...] = (),
            folder: str = "/dev/shm") -> list[str]:
    """Names of the pmetal objects in ``folder`` (where it can be listed);
    those made by one of ``creators`` or for one of ``readers`` when given
    (pids of this pid namespace)."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _NAME.fullmatch("/" + entry)
        if match is None:
            continue
        if creators or readers:
            if match.group(1) != _ns_tag():
                continue
            if creators and int(match.group(2), 36) not in creators:
                continue
            if readers and int(match.group(3), 36) not in readers:
                continue
        found.append("/" + entry)
    return found


def sweep(folder: str = "/dev/shm") -> list[str]:
    """Unlink the objects left by dead processes: those whose reader is
    dead (nobody will map them), and those with no recorded reader whose
    creator is dead. Returns the names unlinked. Objects of other pid
    namespaces are left alone (their pids mean nothing here), as are other
    users'. Where the objects cannot be listed (macOS), does nothing."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    tag = _ns_tag()
    removed = []
    for entry in entries:
        match = _NAME.fullmatch("/" + entry)
        if match is None or match.group(1) != tag:
            continue
        creator, reader = int(match.group(2), 36), int(match.group(3), 36)
        if pid_alive(reader) if reader else pid_alive(creator):
            continue
        try:
            _posixshmem.shm_unlink("/" + entry)
        except (FileNotFoundError, PermissionError):
            continue
        removed.append("/" + entry)
    if removed:
        log.info("unlinked %d shared-memory objects of dead processes", len(removed))
    return removed


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

    def __init__(self, max_free_bytes: int = 128 << 20, reader: int = 0) -> None:
        self.reader = reader
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
            name = _new_name(self.reader)
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
    if not _valid_name(name):
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
