"""Closing an asyncio dialer must not close a socket opened after it.

A dialer used from asyncio has a zmq.asyncio twin shadowing its socket;
closing the twin closes the libzmq socket, and libzmq may put the next new
socket at the same address. The sync wrapper, garbage collected later, must
not take that new socket for its own and close it (seen as 'Socket
operation on non-socket' when a node constructed an actor right after a
status ask gave up on a worker, and as handshakes that never got a Welcome).
"""

from __future__ import annotations

import gc

from pmetal.aio import run
from pmetal.errors import PMetalTimeoutError
from pmetal.transport import ZmqTransport


def test_a_closed_async_dialer_leaves_later_sockets_alone() -> None:
    async def main() -> int:
        transport = ZmqTransport()
        listener = transport.listen("tcp://127.0.0.1:0")
        answered = 0
        try:
            for _ in range(100):
                gone = transport.dial(listener.address)
                await gone.asend([b"unanswered"])
                try:
                    await gone.arecv(0.001)
                except PMetalTimeoutError:
                    pass
                gone.close()
                fresh = transport.dial(listener.address)
                del gone
                gc.collect()   # the old wrapper goes now, after the new socket exists
                await fresh.asend([b"hello"])
                while True:
                    route, frames = await listener.arecv(5.0)
                    if bytes(frames[0]) == b"hello":
                        break
                await listener.asend(route, [b"welcome"])
                assert bytes((await fresh.arecv(5.0))[0]) == b"welcome"
                answered += 1
                fresh.close()
        finally:
            listener.close()
        return answered

    # The suite's heap makes each full collection slow (15 s for the loop):
    # frozen, the objects that exist before it are left out of the collections.
    gc.freeze()
    try:
        assert run(main()) == 100
    finally:
        gc.unfreeze()
