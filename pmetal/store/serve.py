"""The node daemon's side of the model store: answering ``ModelQuery`` and
``PieceRead`` from the node's own store.

Only processes that completed the namespace handshake reach this (the
node's :class:`~pmetal.endpoint.SecureListener` delivers nothing else), so a
stranger without the PSK gets no byte. Reads run in a thread, never on the
node's event loop, at most :data:`MAX_READS` at once: a node serves pieces
with at most ``MAX_READS * MAX_CHUNK`` bytes in memory, whoever asks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from pmetal.store.errors import ModelError
from pmetal.store.folder import PieceStore
from pmetal.values import FailureKind
from pmetal.wire import (
    Failure,
    Message,
    ModelHoldings,
    ModelQuery,
    PieceData,
    PieceRead,
)

__all__ = ["MAX_CHUNK", "MAX_READS", "STORE_KINDS", "PieceServer", "StoreStatistics"]

log = logging.getLogger(__name__)

MAX_CHUNK = 4 << 20
"""Most bytes one PieceRead may ask for."""
MAX_READS = 8
"""Reads a node serves at once (the others wait their turn)."""
STORE_KINDS = (ModelQuery, PieceRead)


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What a node's store served: requests answered (``queries``:
    ModelQuery, ``reads``: PieceRead with its bytes), ``bytes_served``, and
    requests refused (unknown model, bytes not held, bad range)."""

    queries: int
    reads: int
    bytes_served: int
    refused: int


class PieceServer:
    """Answers the store's requests for one node (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.store = PieceStore(root)
        self._reads = asyncio.Semaphore(MAX_READS)
        self._counts = {"queries": 0, "reads": 0, "bytes": 0, "refused": 0}

    def statistics(self) -> StoreStatistics:
        c = self._counts
        return StoreStatistics(c["queries"], c["reads"], c["bytes"], c["refused"])

    async def answer(self, body: Message) -> Message:
        async with self._reads:
            reply = await asyncio.to_thread(self._answer, body)
        if isinstance(reply, Failure):
            self._counts["refused"] += 1
        elif isinstance(reply, ModelHoldings):
            self._counts["queries"] += 1
        else:
            self._counts["reads"] += 1
            self._counts["bytes"] += len(reply.data)  # type: ignore[attr-defined]
        return reply

    def _answer(self, body: Message) -> Message:
        sha = body.sha256  # type: ignore[attr-defined]
        try:
            entry = self.store.open(sha)
        except ModelError as exc:
            return Failure(FailureKind.BAD_REQUEST, type(exc).__name__, str(exc))
        if entry is None:
            return Failure(FailureKind.NOT_FOUND, "ModelUnavailableError",
                           f"this node holds nothing of model {sha[:12]}")
        import numpy as np  # here: a node that serves no model starts without numpy
        if isinstance(body, ModelQuery):
            return ModelHoldings(np.frombuffer(entry.manifest.encode(), np.uint8),
                                 entry.held())
        assert isinstance(body, PieceRead)
        if not 0 < body.length <= MAX_CHUNK:
            return Failure(FailureKind.BAD_REQUEST, "ValueError",
                           f"a PieceRead of {body.length} bytes: 1 to {MAX_CHUNK} per request")
        try:
            data = entry.read(body.offset, body.length)
        except ModelError as exc:
            return Failure(FailureKind.NOT_FOUND, "ModelUnavailableError", str(exc))
        return PieceData(np.frombuffer(data, np.uint8))
