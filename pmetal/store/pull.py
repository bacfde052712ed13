"""Pulling the pieces of a model a process needs from the members that hold them.

:class:`Puller` asks node daemons (any member of the namespace: the
driver's node, the others) over the namespace's authenticated channels
(ZeroMQ CURVE keyed by the PSK under pmetal's own sealed sessions) what they
hold of a model (``ModelQuery``), then reads the pieces it lacks in chunks
of :data:`CHUNK` bytes, :data:`WINDOW` requests in flight (``PieceRead``):
at most ``CHUNK * WINDOW`` bytes of a transfer are in memory, whatever the
size of the model. Each chunk goes straight into the store's sparse file;
each piece's sha256 is checked once its last byte is in, and only then is
the piece marked held (:class:`~pmetal.store.folder.ModelFolder`). A piece
that fails its check is zeroed and never marked: the member that sent it is
not asked again, and the next member that holds the piece is.

A member that dies or stalls mid-transfer (no reply within the request
timeout) is dropped for this pull and the transfer resumes, from the byte it
stopped at, with the next member holding the rest. When no member is left
the error (:class:`ModelUnavailableError`, or :class:`ChecksumError` when
members sent bad bytes) names the model, the pieces, every member asked and
what happened there, and what to do.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from pmetal.channel import Channel
from pmetal.config import PMetalConfig
from pmetal.errors import PMetalError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.store.errors import ChecksumError, ModelError, ModelUnavailableError
from pmetal.store.folder import ModelFolder, PieceStore
from pmetal.store.manifest import Manifest, Piece
from pmetal.transport import ZmqTransport
from pmetal.wire import Failure, ModelHoldings, ModelQuery, PieceData, PieceRead

__all__ = ["CHUNK", "WINDOW", "PullProgress", "PullResult", "Puller"]

log = logging.getLogger(__name__)

CHUNK = 1 << 20
"""Bytes per PieceRead (ZeroMQ moves 1 MiB frames fastest)."""
WINDOW = 8
"""PieceReads in flight per transfer."""
_COMMIT_BYTES = 64 << 20   # checked bytes marked held (one fsync) at least this often


@dataclass(frozen=True)
class PullProgress:
    """How a pull goes: ``done`` of ``total`` bytes, now from ``source``."""

    model: str
    done: int
    total: int
    source: str
    note: str = ""


@dataclass
class PullResult:
    """What a pull did: the bytes it moved, and from which members."""

    folder: ModelFolder
    pulled: int = 0
    pieces: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class _Source:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: Channel | None = None
        self.held: bytes | None = None
        self.failed = ""


class _Transfer:
    """One piece's bytes so far (resumable from another member)."""

    def __init__(self, piece: Piece) -> None:
        self.piece = piece
        self.hash = hashlib.sha256()
        self.done = 0


class Puller:
    """Pulls model pieces from the node daemons at ``sources`` (addresses,
    ``tcp://host:port``, the most likely holder first) into ``store``.
    ``transport`` and ``identity`` default to new ones (a CLI); a process of
    the cluster passes its own."""

    def __init__(self, store: PieceStore, sources: Sequence[str], *,
                 namespace: NetworkNamespace, config: PMetalConfig,
                 identity: NodeIdentity | None = None, transport: ZmqTransport | None = None,
                 progress: Callable[[PullProgress], None] | None = None,
                 timeout: float | None = None) -> None:
        self.store = store
        self.sources = [_Source(a) for a in dict.fromkeys(sources)]
        self.namespace = namespace
        self.config = config
        self.identity = identity or NodeIdentity.generate()
        self.transport = transport or ZmqTransport(config.transport,
                                                   curve=namespace.curve_keys())
        self.progress = progress
        self.timeout = timeout if timeout is not None else config.transport.request_timeout

    # ------------------------------------------------------------ queries

    def _channel(self, source: _Source) -> Channel:
        if source.channel is None:
            source.channel = Channel(self.transport.dial(source.address), self.identity,
                                     self.namespace, self.config)
        return source.channel

    def _drop(self, source: _Source, why: str) -> None:
        source.failed = why
        if source.channel is not None:
            source.channel.abandon()
            source.channel.close()
            source.channel = None
        log.warning("model pieces: %s is dropped for this pull: %s", source.address, why)

    def _holdings(self, source: _Source, sha256: str) -> ModelHoldings | None:
        try:
            body = self._channel(source).request(ModelQuery(sha256),
                                                 timeout=self.timeout).body
        except PMetalError as exc:
            self._drop(source, f"did not answer: {exc}")
            return None
        if isinstance(body, ModelHoldings) and _is_buffer(body.manifest):
            source.held = bytes(body.held)
            return body
        why = body.message if isinstance(body, Failure) else type(body).__name__
        source.held = b""
        source.failed = source.failed or f"holds nothing of it ({why})"
        return None

    def manifest(self, sha256: str, digest: str | None = None) -> Manifest:
        """The manifest of model ``sha256``: the store's own, or the first
        member's that holds the model (checked against ``digest`` when given)."""
        local = self.store.open(sha256)
        if local is not None:
            if digest is not None and local.manifest.digest != digest:
                raise ModelError(f"this node's manifest of model {sha256[:12]} has digest "
                                 f"{local.manifest.digest[:12]}, not the driver's "
                                 f"{digest[:12]}: remove it ('pmetal models remove "
                                 f"{sha256}') and build the pipeline again")
            return local.manifest
        for source in self.sources:
            if source.failed:
                continue
            holdings = self._holdings(source, sha256)
            if holdings is None:
                continue
            try:
                return Manifest.decode(bytes(holdings.manifest), sha256=sha256, digest=digest)
            except ModelError as exc:
                self._drop(source, f"sent a bad manifest: {exc}")
        raise self._unavailable(sha256, "its manifest", [])

    # ------------------------------------------------------------ pulling

    def pull(self, sha256: str, names: Iterable[str] | None = None, *,
             digest: str | None = None) -> PullResult:
        """Hold the pieces ``names`` (tensor names; the header always; None:
        every piece) of model ``sha256`` in the store, pulling those it
        lacks; the pull that completes the file checks it whole."""
        started = time.monotonic()
        manifest = self.manifest(sha256, digest)
        folder = self.store.create(manifest)
        wanted = manifest.named(names) if names is not None else list(manifest.pieces)
        result = PullResult(folder)
        held = folder.held()
        need = [p for p in wanted if not held[p.index]]
        if need:
            mine = [p for p in need if folder.try_lock(p)]
            others = [p for p in need if p not in mine]
            try:
                self._pull(folder, mine, result)
            finally:
                for p in mine:
                    folder.unlock(p)
            for p in others:   # another process of this machine pulls them: wait, or take over
                folder.lock(p, stall=max(30.0, 4 * self.timeout))
                try:
                    if not folder.held()[p.index]:
                        self._pull(folder, [p], result)
                finally:
                    folder.unlock(p)
        if result.pulled and folder.info().complete:
            folder.verify_whole()   # the last piece arrived: the file, whole
        result.seconds = time.monotonic() - started
        return result

    def _pull(self, folder: ModelFolder, pieces: list[Piece], result: PullResult) -> None:
        if not pieces:
            return
        sha = folder.manifest.sha256
        total = sum(p.length for p in pieces)
        transfers = {p.index: _Transfer(p) for p in pieces}
        bad: list[str] = []
        with folder.writer() as fd:
            try:
                while transfers:
                    first = next(iter(transfers.values())).piece
                    source = self._source_for(sha, first)
                    if source is None:
                        left = [t.piece for t in transfers.values()]
                        if bad:
                            raise ChecksumError(self._unavailable(sha, _names(left), bad).args[0])
                        raise self._unavailable(sha, _names(left), bad)
                    run = []
                    for t in transfers.values():
                        if not _holds(source, t.piece):
                            break
                        run.append(t)
                    try:
                        self._transfer(source, folder, fd, run, transfers, result, total)
                    except _BadPiece as exc:
                        bad.append(f"{source.address} sent {exc.args[0]}")
                        self._drop(source, f"sent {exc.args[0]}")
                    except PMetalError as exc:
                        self._drop(source, f"failed mid-transfer: {exc}")
                        self._say(sha, result, total, source.address,
                                  f"{source.address} failed ({exc}); resuming elsewhere")
            finally:
                for t in transfers.values():    # unchecked bytes are never left behind
                    if t.done:
                        folder.erase(fd, t.piece, t.piece.offset + t.done)

    def _source_for(self, sha256: str, piece: Piece) -> _Source | None:
        for source in self.sources:
            if source.failed:
                continue
            if source.held is None and self._holdings(source, sha256) is None:
                continue
            if _holds(source, piece):
                return source
        return None

    def _transfer(self, source: _Source, folder: ModelFolder, fd: int, run: list[_Transfer],
                  transfers: dict[int, _Transfer], result: PullResult, total: int) -> None:
        sha = folder.manifest.sha256
        channel = self._channel(source)
        chunks = ((t, t.piece.offset + at, min(CHUNK, t.piece.length - at))
                  for t in run for at in range(t.done, t.piece.length, CHUNK))
        flight: collections.deque[tuple[int, _Transfer, int, int]] = collections.deque()
        checked: list[Piece] = []
        unmarked = 0
        try:
            for chunk in chunks:
                flight.append((channel.submit(PieceRead(sha, chunk[1], chunk[2]),
                                              timeout=self.timeout), *chunk))
                if len(flight) < WINDOW:
                    continue
                unmarked += self._receive(channel, flight.popleft(), folder, fd, checked,
                                          transfers, result, total, source.address)
                if unmarked >= _COMMIT_BYTES:
                    folder.commit(fd, checked)
                    checked, unmarked = [], 0
            while flight:
                self._receive(channel, flight.popleft(), folder, fd, checked, transfers,
                              result, total, source.address)
        finally:
            folder.commit(fd, checked)

    def _receive(self, channel: Channel, item: tuple[int, _Transfer, int, int],
                 folder: ModelFolder, fd: int, checked: list[Piece],
                 transfers: dict[int, _Transfer], result: PullResult, total: int,
                 address: str) -> int:
        corr, transfer, offset, length = item
        body = channel.result(corr, timeout=self.timeout).body
        if not isinstance(body, PieceData):
            why = body.message if isinstance(body, Failure) else type(body).__name__
            raise ModelUnavailableError(f"refused bytes {offset}..{offset + length}: {why}")
        piece = transfer.piece
        if not _is_buffer(body.data):
            raise _BadPiece(f"a {type(body.data).__name__} for {piece.name}, not its bytes")
        data = memoryview(body.data).cast("B")
        if len(data) != length or offset != piece.offset + transfer.done:
            raise _BadPiece(f"{len(data)} bytes at {offset} for {piece.name}, not {length}")
        written = 0
        while written < length:
            written += os.pwrite(fd, data[written:], offset + written)
        transfer.hash.update(data)
        transfer.done += length
        result.pulled += length
        result.sources[address] = result.sources.get(address, 0) + length
        if transfer.done < piece.length:
            self._say(folder.manifest.sha256, result, total, address)
            return length
        if transfer.hash.hexdigest() != piece.sha256:
            got = transfer.hash.hexdigest()
            folder.erase(fd, piece)
            transfer.hash, transfer.done = hashlib.sha256(), 0   # from the next member, whole
            raise _BadPiece(f"{piece.name} with sha256 {got[:16]}..., not {piece.sha256[:16]}... "
                            "(a tampered or corrupt piece: refused, not stored)")
        del transfers[piece.index]
        checked.append(piece)
        result.pieces += 1
        self._say(folder.manifest.sha256, result, total, address)
        return length

    # ------------------------------------------------------------- errors

    def _unavailable(self, sha256: str, what: Any, bad: list[str]) -> ModelUnavailableError:
        tried = "; ".join(f"{s.address}: {s.failed or 'holds none of it'}"
                          for s in self.sources) or "no member was given"
        if isinstance(what, list):
            what = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
        return ModelUnavailableError(
            f"model {sha256[:12]}...: no member could send {what} (asked {tried}"
            f"{'; ' + '; '.join(bad) if bad else ''}). Fetch the model on one machine of the "
            f"cluster ('pmetal models fetch NAME', or 'pmetal models pull {sha256} --from "
            "ADDRESS' from a machine that has it), or bring back the member that held it, "
            "then try again")

    def _say(self, sha256: str, result: PullResult, total: int, source: str,
             note: str = "") -> None:
        if self.progress is not None:
            self.progress(PullProgress(sha256, min(result.pulled, total), total, source, note))

    def close(self) -> None:
        for source in self.sources:
            if source.channel is not None:
                source.channel.close()
                source.channel = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BadPiece(PMetalError):
    """A member sent bytes that are not the piece."""


def _is_buffer(value: Any) -> bool:
    """Bytes as a member sends them (``bytes(5)`` of a crafted int would
    allocate, so nothing else is turned into bytes)."""
    return isinstance(value, (bytes, bytearray, memoryview, np.ndarray)) and (
        not isinstance(value, np.ndarray) or value.dtype == np.uint8)


def _holds(source: _Source, piece: Piece) -> bool:
    held = source.held or b""
    return piece.index < len(held) and bool(held[piece.index])


def _names(pieces: list[Piece]) -> list[str]:
    return [p.name for p in pieces]
