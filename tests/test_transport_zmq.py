"""ZeroMQ transport specifics the conformance suite does not cover."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pmetal.config import TransportConfig
from pmetal.errors import PMetalTimeoutError
from pmetal.transport import ZmqTransport


def test_closing_a_dialer_used_from_asyncio_leaves_later_sockets_alone() -> None:
    # Closing the asyncio twin of a socket closes the ZeroMQ socket; the
    # owning object must not close that address again when it is collected:
    # libzmq hands the memory to the next socket, which would then fail with
    # "Socket operation on non-socket".
    transport = ZmqTransport(TransportConfig())
    listener = transport.listen("tcp://127.0.0.1:0")
    # Everything the test session made so far moves to the permanent
    # generation: each collect() below then scans what this test made, not
    # the whole suite's heap (0.4 s a collect late in a full run). The old
    # dialer and its twin are made after the freeze: they are collected.
    gc.freeze()
    try:
        for _ in range(20):
            old = transport.dial(listener.address)

            async def touch() -> None:
                with pytest.raises(PMetalTimeoutError):  # nothing comes: it only makes the twin
                    await old.arecv(timeout=0.001)

            asyncio.run(touch())
            old.close()
            new = transport.dial(listener.address)
            del old
            gc.collect()
            new.send([b"still open"], timeout=1.0)
            new.close()
    finally:
        gc.unfreeze()
        listener.close()
