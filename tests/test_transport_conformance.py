"""One conformance suite for every transport (the contract in
``pmetal/transport.py``), run against ZeroMQ over TCP loopback and against
the in-memory transport. ZeroMQ-only behaviour (reconnection) comes last."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import WAIT, Net, as_bytes, listen_again, make_config

from pmetal.errors import (
    BackpressureError,
    ClosedError,
    PeerError,
    PMetalError,
    PMetalTimeoutError,
    TransportError,
)


def connect(net: Net) -> tuple[Any, Any, bytes]:
    """A listener, a dialer to it, and the dialer's route as the listener sees it."""
    listener = net.listen()
    dialer = net.dial(listener.address)
    dialer.send([b"hello"])
    route, frames = listener.recv(timeout=WAIT)
    assert as_bytes(frames) == [b"hello"]
    return listener, dialer, route


# ------------------------------------------------------------- round trips

ROUND_TRIP_MESSAGES = {
    "one small frame": [b"ping"],
    "several frames": [b"envelope", b"buffer 1", b"buffer 2"],
    "empty frames": [b"", b"middle", b""],
    "one empty frame": [b""],
    "large frames": [os.urandom(64 * 1024 + 1), b"x", os.urandom(3 * 1024 * 1024 + 17)],
}


@pytest.mark.parametrize("frames", ROUND_TRIP_MESSAGES.values(), ids=ROUND_TRIP_MESSAGES.keys())
def test_round_trip_preserves_frames(make_net: Callable[..., Net], frames: list[bytes]) -> None:
    listener, dialer, route = connect(make_net())
    dialer.send(frames)
    got_route, got = listener.recv(timeout=WAIT)
    assert got_route == route
    assert as_bytes(got) == frames
    listener.send(route, frames)
    assert as_bytes(dialer.recv(timeout=WAIT)) == frames


def test_round_trip_of_buffer_objects(make_net: Callable[..., Net]) -> None:
    """Frames may be memoryviews and numpy buffers, not only bytes; the
    sender may reuse its buffer as soon as send returns."""
    listener, dialer, _route = connect(make_net())
    arr = np.arange(50_000, dtype=np.float64)  # 400 kB: the zero-copy path
    small = bytearray(b"small and mutable")
    dialer.send([memoryview(small), memoryview(arr).cast("B"), arr[:10]])
    _, got = listener.recv(timeout=WAIT)
    got = as_bytes(got)
    assert got[0] == b"small and mutable"
    assert got[1] == arr.tobytes()
    assert got[2] == arr[:10].tobytes()


def test_messages_from_one_dialer_arrive_in_order(make_net: Callable[..., Net]) -> None:
    listener, dialer, route = connect(make_net())
    count = 2000
    for i in range(count):
        dialer.send([b"seq", i.to_bytes(4, "little"), b"x" * (i % 97)])
    for i in range(count):
        _, frames = listener.recv(timeout=WAIT)
        assert as_bytes(frames) == [b"seq", i.to_bytes(4, "little"), b"x" * (i % 97)]
    # ... and the other way round.
    for i in range(count):
        listener.send(route, [i.to_bytes(4, "little")])
    assert [int.from_bytes(as_bytes(dialer.recv(timeout=WAIT))[0], "little")
            for _ in range(count)] == list(range(count))


def test_replies_reach_the_right_dialer(make_net: Callable[..., Net]) -> None:
    net = make_net()
    listener = net.listen()
    dialers = [net.dial(listener.address) for _ in range(6)]
    for round_ in range(3):
        for i, dialer in enumerate(dialers):
            dialer.send([b"from", str(i).encode(), str(round_).encode()])
        routes: dict[bytes, bytes] = {}
        for _ in dialers:
            route, frames = listener.recv(timeout=WAIT)
            name = as_bytes(frames)[1]
            assert routes.setdefault(name, route) == route
            # Answer with the sender's own name: each dialer must get its own.
            listener.send(route, [b"you are", name, str(round_).encode()])
        assert len(set(routes.values())) == len(dialers)
        for i, dialer in enumerate(dialers):
            assert as_bytes(dialer.recv(timeout=WAIT)) == [b"you are", str(i).encode(),
                                                           str(round_).encode()]


# ----------------------------------------------------------------- timeouts

@pytest.mark.parametrize("side", ["listener", "dialer"])
def test_recv_times_out_within_bounds(make_net: Callable[..., Net], side: str) -> None:
    listener, dialer, _route = connect(make_net())
    sock = listener if side == "listener" else dialer
    for timeout in (0.0, 0.2):
        start = time.monotonic()
        with pytest.raises(PMetalTimeoutError) as info:
            sock.recv(timeout=timeout)
        elapsed = time.monotonic() - start
        assert isinstance(info.value, TimeoutError)
        assert timeout * 0.9 <= elapsed < timeout + 1.0
    # A timeout does not spoil the socket.
    dialer.send([b"after timeout"])
    assert as_bytes(listener.recv(timeout=WAIT)[1]) == [b"after timeout"]


@pytest.mark.parametrize("side", ["listener", "dialer"])
def test_arecv_times_out_within_bounds(make_net: Callable[..., Net], side: str) -> None:
    listener, dialer, route = connect(make_net())
    sock = listener if side == "listener" else dialer

    async def scenario() -> float:
        start = time.monotonic()
        with pytest.raises(PMetalTimeoutError) as info:
            await sock.arecv(timeout=0.2)
        assert isinstance(info.value, TimeoutError)
        return time.monotonic() - start

    elapsed = asyncio.run(asyncio.wait_for(scenario(), WAIT))
    assert 0.18 <= elapsed < 1.2
    # The event loop that waited is gone; the socket must not remember it.
    if side == "listener":
        dialer.send([b"after the loop closed"])
        assert as_bytes(listener.recv(timeout=WAIT)[1]) == [b"after the loop closed"]
    else:
        listener.send(route, [b"after the loop closed"])
        assert as_bytes(dialer.recv(timeout=WAIT)) == [b"after the loop closed"]
    sock.close()


def test_arecv_timeouts_do_not_pile_up_waiters(make_net: Callable[..., Net]) -> None:
    """Many timed-out arecv calls in one loop, then a message: delivered once,
    to the one waiting receiver, and the loop shuts down cleanly."""
    listener, dialer, route = connect(make_net())

    async def scenario() -> list[bytes]:
        for _ in range(50):
            with pytest.raises(PMetalTimeoutError):
                await dialer.arecv(timeout=0.001)
        waiting = asyncio.ensure_future(dialer.arecv(timeout=WAIT))
        await asyncio.sleep(0)
        await asyncio.to_thread(listener.send, route, [b"wake"])
        return as_bytes(await waiting)

    assert asyncio.run(asyncio.wait_for(scenario(), WAIT)) == [b"wake"]
    listener.send(route, [b"later"])
    assert as_bytes(dialer.recv(timeout=WAIT)) == [b"later"]


# ---------------------------------------------------------------- interrupt

def test_interrupt_from_another_thread_wakes_a_blocked_recv(make_net: Callable[..., Net]
                                                            ) -> None:
    listener, dialer, _route = connect(make_net())
    outcome: list[PMetalError | tuple] = []
    entered = threading.Event()

    def serve() -> None:
        entered.set()
        try:
            outcome.append(listener.recv(timeout=WAIT))
        except PMetalError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=serve)
    start = time.monotonic()
    thread.start()
    assert entered.wait(WAIT)
    listener.interrupt()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert time.monotonic() - start < WAIT * 0.8, "recv waited for its own timeout"
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError), outcome
    # The listener is still usable afterwards (only the blocked recv was woken).
    dialer.send([b"still there"])
    assert as_bytes(listener.recv(timeout=WAIT)[1]) == [b"still there"]


def test_interrupt_wakes_a_blocked_arecv(make_net: Callable[..., Net]) -> None:
    listener, _dialer, _route = connect(make_net())

    async def scenario() -> None:
        task = asyncio.ensure_future(listener.arecv(timeout=WAIT))
        await asyncio.sleep(0)  # let arecv start waiting
        thread = threading.Thread(target=listener.interrupt)
        thread.start()
        with pytest.raises(ClosedError):
            await asyncio.wait_for(task, WAIT * 0.8)
        thread.join(WAIT)

    asyncio.run(scenario())


# ------------------------------------------------------------------- closing

def test_closed_sockets_raise_closed_error(make_net: Callable[..., Net]) -> None:
    listener, dialer, route = connect(make_net())
    dialer.close()
    dialer.close()  # idempotent
    with pytest.raises(ClosedError):
        dialer.send([b"x"])
    with pytest.raises(ClosedError):
        dialer.recv(timeout=0.1)
    listener.close()
    listener.close()
    with pytest.raises(ClosedError):
        listener.recv(timeout=0.1)
    with pytest.raises(ClosedError):
        listener.send(route, [b"x"])

    async def scenario() -> None:
        with pytest.raises(ClosedError):
            await dialer.asend([b"x"])
        with pytest.raises(ClosedError):
            await dialer.arecv(timeout=0.1)
        with pytest.raises(ClosedError):
            await listener.arecv(timeout=0.1)
        with pytest.raises(ClosedError):
            await listener.asend(route, [b"x"])

    asyncio.run(scenario())


def test_closed_dialer_does_not_hand_out_queued_messages(make_net: Callable[..., Net]) -> None:
    """ClosedError means "we closed it": even a message that arrived before
    the close must not come out of a closed socket."""
    listener, dialer, route = connect(make_net())
    listener.send(route, [b"queued"])
    dialer.send([b"sync"])  # the listener sees this after its own send went out
    listener.recv(timeout=WAIT)
    dialer.close()
    with pytest.raises(ClosedError):
        dialer.recv(timeout=0.1)


def test_closed_listener_does_not_hand_out_queued_messages(make_net: Callable[..., Net]
                                                           ) -> None:
    listener, dialer, _route = connect(make_net())
    dialer.send([b"one"])
    dialer.send([b"two"])
    assert as_bytes(listener.recv(timeout=WAIT)[1]) == [b"one"]  # "two" is queued or close
    listener.close()
    with pytest.raises(ClosedError):
        listener.recv(timeout=0.1)


# ------------------------------------------------------------- unknown peer

def test_send_to_unknown_route_raises_peer_error(make_net: Callable[..., Net]) -> None:
    listener, dialer, route = connect(make_net())
    unknown = os.urandom(8)
    with pytest.raises(PeerError):
        listener.send(unknown, [b"to nobody"])

    async def scenario() -> None:
        with pytest.raises(PeerError):
            await listener.asend(unknown, [b"to nobody"])

    asyncio.run(scenario())
    # The known peer is unaffected.
    listener.send(route, [b"to you"])
    assert as_bytes(dialer.recv(timeout=WAIT)) == [b"to you"]


def test_errors_belong_to_the_pmetal_tree() -> None:
    for exc in (ClosedError, PeerError, BackpressureError):
        assert issubclass(exc, TransportError) and issubclass(exc, PMetalError)
    assert issubclass(PMetalTimeoutError, TimeoutError)


# -------------------------------------------------------------- backpressure

BACKPRESSURE_FRAME = b"\0" * (64 * 1024)
MAX_ACCEPTED = 10_000


def fill_until_backpressure(send: Callable[[], None], send_timeout: float) -> int:
    """Send until BackpressureError; return how many sends were accepted.
    Every send must return or fail within its deadline."""
    accepted = 0
    while True:
        start = time.monotonic()
        try:
            send()
        except BackpressureError:
            elapsed = time.monotonic() - start
            assert elapsed < send_timeout + 1.0, f"send blocked {elapsed:.2f} s"
            return accepted
        elapsed = time.monotonic() - start
        assert elapsed < send_timeout + 1.0, f"send blocked {elapsed:.2f} s"
        accepted += 1
        assert accepted < MAX_ACCEPTED, "sends never pushed back: memory grows without bound"


@pytest.mark.parametrize("direction", ["dialer to listener", "listener to dialer"])
def test_backpressure_bounds_a_peer_that_never_reads(make_net: Callable[..., Net],
                                                     direction: str) -> None:
    cfg = make_config(send_hwm=5, recv_hwm=5, send_timeout=0.3)
    net = make_net(cfg)
    listener, dialer, route = connect(net)
    if direction == "dialer to listener":
        def send() -> None:
            dialer.send([BACKPRESSURE_FRAME])
    else:
        def send() -> None:
            listener.send(route, [BACKPRESSURE_FRAME])
    accepted = fill_until_backpressure(send, 0.3)
    if net.kind == "memory":
        assert accepted == 5  # exactly the receiver's capacity
    else:
        # ZeroMQ queues in both sockets and the kernel buffers TCP: loose bound.
        assert 5 <= accepted < MAX_ACCEPTED
    # An explicit timeout overrides send_timeout, and still fails, in time.
    start = time.monotonic()
    with pytest.raises(BackpressureError):
        if direction == "dialer to listener":
            dialer.send([BACKPRESSURE_FRAME], timeout=0.1)
        else:
            listener.send(route, [BACKPRESSURE_FRAME], timeout=0.1)
    assert time.monotonic() - start < 1.1


def test_backpressure_on_asend(make_net: Callable[..., Net]) -> None:
    cfg = make_config(send_hwm=5, recv_hwm=5, send_timeout=0.3)
    _listener, dialer, _route = connect(make_net(cfg))

    async def scenario() -> int:
        accepted = 0
        while True:
            start = time.monotonic()
            try:
                await dialer.asend([BACKPRESSURE_FRAME])
            except BackpressureError:
                assert time.monotonic() - start < 1.3
                return accepted
            accepted += 1
            assert accepted < MAX_ACCEPTED

    accepted = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert accepted >= 5


def test_backpressure_clears_when_the_peer_reads(make_net: Callable[..., Net]) -> None:
    cfg = make_config(send_hwm=5, recv_hwm=5, send_timeout=0.3)
    listener, dialer, _route = connect(make_net(cfg))
    accepted = fill_until_backpressure(lambda: dialer.send([BACKPRESSURE_FRAME]), 0.3)
    for _ in range(accepted):
        _, frames = listener.recv(timeout=WAIT)
        assert as_bytes(frames) == [BACKPRESSURE_FRAME]
    dialer.send([b"flows again"], timeout=WAIT)
    assert as_bytes(listener.recv(timeout=WAIT)[1]) == [b"flows again"]


# -------------------------------------------------------------------- asyncio

def test_async_twins_round_trip(make_net: Callable[..., Net]) -> None:
    net = make_net()
    listener = net.listen()
    dialers = [net.dial(listener.address) for _ in range(3)]
    big = os.urandom(200_000)

    async def serve(count: int) -> None:
        for _ in range(count):
            route, frames = await listener.arecv(timeout=WAIT)
            await listener.asend(route, [b"echo", *frames])

    async def client(i: int, dialer: Any) -> None:
        for j in range(20):
            frames = [str(i).encode(), str(j).encode(), big if j % 5 == 0 else b""]
            await dialer.asend(frames)
            assert as_bytes(await dialer.arecv(timeout=WAIT)) == [b"echo", *frames]

    async def scenario() -> None:
        await asyncio.gather(serve(60), *(client(i, d) for i, d in enumerate(dialers)))

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_sync_and_async_calls_mix_on_one_socket(make_net: Callable[..., Net]) -> None:
    listener, dialer, route = connect(make_net())

    async def scenario() -> None:
        await dialer.asend([b"async"])
        route2, frames = listener.recv(timeout=WAIT)
        assert route2 == route and as_bytes(frames) == [b"async"]
        listener.send(route, [b"sync"])
        assert as_bytes(await dialer.arecv(timeout=WAIT)) == [b"sync"]

    asyncio.run(scenario())
    dialer.send([b"sync again"])
    assert as_bytes(listener.recv(timeout=WAIT)[1]) == [b"sync again"]


# ---------------------------------------------------------- ZeroMQ specifics

@pytest.mark.parametrize("transport_kind", ["zmq"], indirect=True)
def test_zmq_dialer_reaches_a_listener_that_binds_later_and_restarts(
        make_net: Callable[..., Net]) -> None:
    net = make_net()
    with socket.socket() as probe:  # a free port; a plain socket frees it at once
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"

    dialer = net.dial(address)  # nothing listens on that port yet
    dialer.send([b"sent before the listener existed"])
    first = listen_again(lambda: net.listen(address))
    route, frames = first.recv(timeout=WAIT)
    assert as_bytes(frames) == [b"sent before the listener existed"]
    first.send(route, [b"first"])
    assert as_bytes(dialer.recv(timeout=WAIT)) == [b"first"]

    first.close()
    second = listen_again(lambda: net.listen(address))
    # A message sent while the dialer has not yet noticed the old connection
    # died can be lost with it: retry until one gets through, with a deadline.
    deadline = time.monotonic() + WAIT
    while True:
        dialer.send([b"after restart"])
        try:
            route2, frames = second.recv(timeout=0.2)
            break
        except PMetalTimeoutError:
            assert time.monotonic() < deadline, "dialer never reached the new listener"
    assert as_bytes(frames) == [b"after restart"]
    assert route2 == route  # the dialer keeps its identity across reconnects
    second.send(route2, [b"second"])
    replies = as_bytes(dialer.recv(timeout=WAIT))
    assert replies == [b"second"]


def round_trip_works(net: Net) -> bool:
    """A fresh listener and dialer of ``net`` exchange a message (within WAIT)."""
    listener = net.listen()
    dialer = net.dial(listener.address)
    dialer.send([b"still moving?"])
    try:
        route, _ = listener.recv(timeout=WAIT)
        listener.send(route, [b"yes"])
        return as_bytes(dialer.recv(timeout=WAIT)) == [b"yes"]
    except PMetalTimeoutError:
        return False
    finally:
        dialer.close()
        listener.close()


@pytest.mark.parametrize("transport_kind", ["zmq"], indirect=True)
@pytest.mark.parametrize("order", ["listener first", "dialers first", "at the same time"])
def test_closing_monitored_sockets_never_stalls_the_context(
        make_net: Callable[..., Net], order: str) -> None:
    """libzmq sends monitor events from its I/O thread with a blocking send:
    one event for a monitor reader closed too early stops every socket of
    the context. The dialer owns its monitor and closes it safely, whatever
    dies first; a closing listener waits for its own monitor to stop."""
    net = make_net()
    for round_ in range(15):
        listener = net.listen()
        dialers = [net.dial(listener.address) for _ in range(3)]
        monitors = [d.monitor_disconnects() for d in dialers]
        for d in dialers:
            d.send([b"connected"])
            listener.recv(timeout=WAIT)
        if order == "listener first":   # peers see the disconnect, then close
            listener.close()
            for d in dialers:
                d.close()
        elif order == "dialers first":
            for d in dialers:
                d.close()
            listener.close()
        else:
            closer = threading.Thread(target=listener.close)
            closer.start()
            for d in dialers:
                d.close()
            closer.join(WAIT)
            assert not closer.is_alive(), "listener.close() did not return"
        assert all(m.closed for m in monitors), "a dialer left its monitor open"
        assert round_trip_works(net), f"round {round_}: the ZeroMQ context stopped moving"


@pytest.mark.parametrize("transport_kind", ["memory"], indirect=True)
def test_memory_dialer_without_listener_raises_peer_error(make_net: Callable[..., Net]) -> None:
    net = make_net()
    dialer = net.dial("mem://nobody-here")
    with pytest.raises(PeerError):
        dialer.send([b"x"])


def test_closed_listener_frees_its_address_at_once(make_net: Callable[..., Net]) -> None:
    """close() returns with the address free again, so a restarted server
    can listen where it listened before (even with peers connected)."""
    net = make_net()
    listener = net.listen()
    address = listener.address
    for i in range(50):
        dialer = net.dial(address)
        dialer.send([b"connected"])
        listener.recv(timeout=WAIT)
        listener.close()
        dialer.close()
        try:
            listener = net.listen(address)
        except TransportError as exc:
            pytest.fail(f"restart {i}: the closed listener still holds {address}: {exc}")


def test_listen_on_an_address_in_use_fails(make_net: Callable[..., Net]) -> None:
    net = make_net()
    listener = net.listen()
    with pytest.raises(TransportError):
        net.listen(listener.address)
