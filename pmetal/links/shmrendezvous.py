"""How the ranks of one machine find each other for the shared-memory
links (:mod:`pmetal.links.shmlinks`): :func:`join`.

Each rank creates one shared-memory object for its outgoing rings (mode
0600, named as :mod:`pmetal.shm` names its objects, so :func:`pmetal.shm.sweep`
finds it if its creator dies), and meets the others in a rendezvous folder
named by a hash of the group's token: ``/dev/shm/pmetal-<24 hex digits>``
(the ranks share ``/dev/shm`` by definition; elsewhere than Linux, the
temporary folder). The folder is created 0700 by whichever rank comes first
and refused unless it is a folder of this user that nobody else may enter.
Each rank binds ``<rank>.sock`` in it, dials the lower ranks (waiting for
them to bind, with growing pauses up to 50 ms) and accepts the higher ones.

Only the ranks of the group on this machine meet (``ranks``; a world spread
over machines links the others by TCP). Hello (both ways on every socket,
:data:`_HELLO`): magic ``PMH1``, rank, the set of ranks (count and digest),
ring size, pid, pid namespace, the ring object's name, and a 16-byte BLAKE2b MAC
keyed by the token, so that a stale or foreign process in the folder is
refused. Each side then maps the ring the other keeps for it (read-only,
after checking the object is this user's and large enough) and answers
``PMR1`` ("attached"). Once a rank has every ``PMR1``, nobody needs its
names any more: it unlinks its object and socket file, and the last rank
the folder. A SIGKILL after :func:`join` leaves nothing behind; during it, a
socket file in the private folder and the ring object (swept).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import socket
import stat
import struct
import tempfile
import time
from dataclasses import dataclass

from pmetal import shm
from pmetal.errors import (
    HandshakeError,
    PeerError,
    PMetalTimeoutError,
    ProtocolError,
    SecurityError,
    TransportError,
)

__all__ = ["Member", "join"]

# magic, rank, ranks of this machine (count, digest), ring bytes, pid, pid namespace,
# ring object name, MAC
_HELLO = struct.Struct("<4sII8sQQQ32s16s")
_HELLO_MAGIC, _READY = b"PMH1", b"PMR1"


@dataclass(frozen=True)
class Member:
    """Another rank as :func:`join` met it."""

    rank: int
    pid: int
    """Its pid when it shares this process's pid namespace, else 0."""
    sock: socket.socket
    """The connected socket between the two (blocking)."""
    ring: mmap.mmap
    """Its ring for this rank, mapped read-only."""


def slot(reader: int, writer: int, ranks: tuple[int, ...]) -> int:
    """Which of ``writer``'s rings is ``reader``'s (rank order, ``writer``
    left out)."""
    return [r for r in ranks if r != writer].index(reader)


def join(token: str, rank: int, ranks: tuple[int, ...], ring_bytes: int,
         deadline: float) -> tuple[mmap.mmap, list[Member]]:
    """Meet the other ranks of ``ranks`` (sorted, this machine's ranks of
    the group of ``token``): this rank's rings (``ring_bytes`` per peer, at
    :func:`slot`, mapped read-write) and the members. Past ``deadline``:
    :class:`~pmetal.errors.PMetalTimeoutError`; nothing is left behind on
    any failure."""
    if shm._posixshmem is None:
        raise TransportError("shared-memory links need POSIX shared memory, which this "
                             "platform lacks: use the TCP links")
    key, folder = _rendezvous(token)
    me = os.path.join(folder, f"{rank}.sock")
    lower = [r for r in ranks if r < rank]
    name, own = _create_rings(ring_bytes * (len(ranks) - 1))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    members: dict[int, Member] = {}
    socks: list[socket.socket] = []
    try:
        listener.bind(me)
        listener.listen(len(ranks))
        # Dial the lower ranks, accept the higher ones; then every hello.
        socks = [_dial(os.path.join(folder, f"{p}.sock"), deadline) for p in lower]
        for _ in range(len(ranks) - 1 - len(lower)):
            listener.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                socks.append(listener.accept()[0])
            except TimeoutError as exc:
                raise PMetalTimeoutError(f"rank {rank}: not every higher rank dialed in "
                                         "before the deadline") from exc
        hello = _hello(key, rank, ranks, ring_bytes, name)
        for sock in socks:
            sock.sendall(hello)
        for i, sock in enumerate(socks):
            blob = _read(sock, _HELLO.size, deadline)
            peer, pid, peer_name = _check_hello(key, ranks, ring_bytes, blob)
            if peer == rank or peer in members or (i < len(lower) and peer != lower[i]):
                raise HandshakeError(f"rank {rank} met rank {peer} twice, or where it dialed "
                                     "another: two groups share a token")
            ring = _attach(peer, peer_name, slot(rank, peer, ranks), ring_bytes)
            members[peer] = Member(peer, pid, sock, ring)
        for sock in socks:
            sock.sendall(_READY)
        for m in members.values():
            if _read(m.sock, len(_READY), deadline) != _READY:
                raise ProtocolError(f"rank {m.rank} sent something else than {_READY!r}")
    except BaseException:
        for sock in socks:
            sock.close()
        for m in members.values():
            m.ring.close()
        own.close()
        raise
    finally:
        # Every peer mapped our rings (or never will): nothing to find by name.
        shm.unlink(name)
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(me)
        with contextlib.suppress(OSError):
            os.rmdir(folder)   # the last rank out removes it
    return own, [members[r] for r in sorted(members)]


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        try:
            got = sock.recv(n - len(data))
        except TimeoutError as exc:
            raise PMetalTimeoutError("the shared-memory links timed out waiting for a "
                                     "peer's handshake") from exc
        if not got:
            raise PeerError("a peer closed its shared-memory link while connecting")
        data += got
    return data


def _folder(token: str) -> tuple[bytes, str]:
    """The group's key and rendezvous folder: in /dev/shm where there is one
    (the ranks share it by definition), named by a hash of the token."""
    key = hashlib.blake2b(token.encode(), person=b"pm-shmlinks").digest()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return key, os.path.join(base, "pmetal-" + hashlib.blake2b(
        key, digest_size=12, person=b"pm-shml-dir").hexdigest())


def _rendezvous(token: str) -> tuple[bytes, str]:
    """:func:`_folder`, made 0700 here or by another rank; refused unless it
    is a folder we own that nobody else may enter (the name is secret, but a
    folder another user made first must not be used)."""
    key, folder = _folder(token)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SecurityError(f"{folder} is not a private folder of this user: another user "
                            "may be interfering; use a fresh group token")
    return key, folder


def _dial(path: str, deadline: float) -> socket.socket:
    """Connect to a lower rank's socket, waiting (with growing pauses) for
    that rank to bind it."""
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise PMetalTimeoutError(f"no rank listened at {path} before the deadline") \
                    from exc
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def _mac(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(body, key=key, digest_size=16, person=b"pm-shml-hello").digest()


def _digest(ranks: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(repr(ranks).encode(), digest_size=8).digest()


def _hello(key: bytes, rank: int, ranks: tuple[int, ...], ring_bytes: int, name: str) -> bytes:
    body = _HELLO.pack(_HELLO_MAGIC, rank, len(ranks), _digest(ranks), ring_bytes,
                       os.getpid(), shm._pid_namespace(), name.encode(), b"")[:-16]
    return body + _mac(key, body)


def _check_hello(key: bytes, ranks: tuple[int, ...], ring_bytes: int,
                 blob: bytes) -> tuple[int, int, str]:
    magic, rank, count, digest, their_ring, pid, pid_ns, name, mac = _HELLO.unpack(blob)
    if magic != _HELLO_MAGIC or not hmac.compare_digest(mac, _mac(key, blob[:-16])):
        raise HandshakeError("a process in the rendezvous folder does not hold the group's "
                             "token: stale or foreign; use a fresh group token")
    if (count, digest) != (len(ranks), _digest(ranks)) or rank not in ranks:
        raise HandshakeError(f"rank {rank} joined with another set of ranks on this machine "
                             f"than {list(ranks)} ({count} ranks): every rank must pass the "
                             "same ranks")
    if their_ring != ring_bytes:
        raise HandshakeError(f"rank {rank} has rings of {their_ring} bytes, this rank of "
                             f"{ring_bytes}: every rank must pass the same ring_bytes")
    same_ns = pid_ns == shm._pid_namespace() and pid_ns
    return rank, pid if same_ns else 0, name.rstrip(b"\0").decode()


def _create_rings(size: int) -> tuple[str, mmap.mmap]:
    """A new 0600 object of ``size`` bytes, mapped read-write, its pages
    touched now rather than on the first pass of each ring."""
    assert shm._posixshmem is not None
    for attempt in range(3):
        name = shm._new_name(0)
        try:
            fd = shm._posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            break
        except FileExistsError:   # taken (by chance, or by someone who guessed it)
            if attempt == 2:
                raise
    try:
        os.ftruncate(fd, size)
        return name, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        shm.unlink(name)
        raise
    finally:
        os.close(fd)


def _attach(peer: int, name: str, index: int, ring_bytes: int) -> mmap.mmap:
    """Map, read-only, ring ``index`` of rank ``peer``'s object."""
    assert shm._posixshmem is not None
    if not shm._valid_name(name):
        raise HandshakeError(f"rank {peer} named a bad shared-memory object {name!r}")
    fd = shm._posixshmem.shm_open(name, os.O_RDONLY, 0o600)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_size < (index + 1) * ring_bytes:
            raise HandshakeError(f"the rings of rank {peer} ({name}) are not this user's "
                                 "or smaller than it said")
        return mmap.mmap(fd, ring_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                         offset=index * ring_bytes)
    finally:
        os.close(fd)
