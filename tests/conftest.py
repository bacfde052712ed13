"""Shared fixtures: small-timeout configs, transports that clean up after
themselves, identities and namespaces, a secure echo server on loopback and
raw ZeroMQ sockets that speak to it without pmetal's help.

Everything listens on 127.0.0.1 with port 0; every wait has a deadline.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq

from pmetal import shm
from pmetal.config import PMetalConfig, load_config
from pmetal.endpoint import Channel, Incoming, SecureListener, Server
from pmetal.errors import HandshakeError, TransportError
from pmetal.identity import NodeIdentity
from pmetal.memtransport import MemoryTransport
from pmetal.security import Mode, NetworkNamespace, Session, client_finish, client_hello
from pmetal.transport import CurveKeys, ZmqTransport
from pmetal.wire import (
    Confirm,
    ErrorReply,
    Message,
    Ping,
    Pong,
    Rejected,
    Welcome,
    decode,
    encode,
    frame_bytes,
)

T = TypeVar("T")

LOOPBACK = "tcp://127.0.0.1:0"
WAIT = 5.0
"""Deadline for anything that should happen at once on a quiet machine."""

SMALL_TIMEOUTS = {
    "handshake_timeout": 2.0,
    "request_timeout": 2.0,
    "connect_timeout": 2.0,
    "send_timeout": 0.5,
    "reconnect_ivl": 0.05,
    "reconnect_ivl_max": 0.2,
}


def make_config(*, security: dict[str, Any] | None = None, **transport: Any) -> PMetalConfig:
    """A config with small timeouts that ignores the developer's environment."""
    return load_config(env={}, transport={**SMALL_TIMEOUTS, **transport},
                       security=security or {})


def as_bytes(frames: Sequence[Any]) -> list[bytes]:
    """Received frames (bytes, memoryviews or zmq.Frame) as plain bytes."""
    return [bytes(frame_bytes(f)) for f in frames]


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def listen_again(listen: Callable[[], T], deadline: float = WAIT) -> T:
    """``listen()`` on an address whose previous listener was just closed.

    ZeroMQ releases a TCP port in its I/O thread some time after close()
    returns, so an immediate rebind can fail with "address in use" (a bug
    of its own, tested in test_closed_listener_frees_its_address_at_once).
    Tests about what happens *after* a restart retry the bind briefly so
    that they test that, not the race."""
    end = time.monotonic() + deadline
    while True:
        try:
            return listen()
        except TransportError:
            if time.monotonic() > end:
                raise


@pytest.fixture
def config() -> PMetalConfig:
    return make_config()


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    """A private context per test, destroyed at teardown so that a socket a
    test forgot cannot leak into the next one."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


# ------------------------------------------------------------- transports

class Net:
    """One transport plus every listener and dialer made through it, all
    closed at teardown."""

    def __init__(self, kind: str, cfg: PMetalConfig, ctx: zmq.Context) -> None:
        self.kind = kind
        self.config = cfg
        if kind == "zmq":
            self.transport: ZmqTransport | MemoryTransport = ZmqTransport(
                cfg.transport, ctx, curve=TEST_NAMESPACE.curve_keys())
            self.any_address = LOOPBACK
        else:
            self.transport = MemoryTransport(cfg.transport)
            self.any_address = "mem://"
        self._owned: list[Any] = []

    def listen(self, address: str | None = None) -> Any:
        listener = self.transport.listen(address or self.any_address)
        self._owned.append(listener)
        return listener

    def dial(self, address: str) -> Any:
        dialer = self.transport.dial(address)
        self._owned.append(dialer)
        return dialer

    def close(self) -> None:
        """Close everything. A close() that fails is reported as a warning
        rather than a second error: the test that provoked it already failed,
        and the remaining sockets must still be closed."""
        for sock in reversed(self._owned):
            try:
                sock.close()
            except Exception as exc:  # noqa: BLE001 - reported, not hidden
                warnings.warn(f"closing {sock!r} failed: {exc!r}", stacklevel=1)


@pytest.fixture(params=["zmq", "memory"])
def transport_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_net(transport_kind: str, zmq_context: zmq.Context) -> Iterator[Callable[..., Net]]:
    """``make_net(cfg=None)``: a :class:`Net` of the parametrised kind."""
    nets: list[Net] = []

    def make(cfg: PMetalConfig | None = None) -> Net:
        net = Net(transport_kind, cfg or make_config(), zmq_context)
        nets.append(net)
        return net

    yield make
    for net in nets:
        net.close()


# --------------------------------------------------------- identity, namespace

@pytest.fixture
def identity() -> NodeIdentity:
    return NodeIdentity.generate()


TEST_NAMESPACE = NetworkNamespace("test", b"0123456789abcdef-test-psk")


@pytest.fixture
def namespace() -> NetworkNamespace:
    return TEST_NAMESPACE


# ------------------------------------------------------------- secure server

class Recorder:
    """A handler that records what it was given and answers Ping with Pong.

    ``answer`` can be replaced to change the reply; ``called`` is set on
    every call so a test can wait for one.
    """

    def __init__(self) -> None:
        self.calls: list[Incoming] = []
        self.called = threading.Event()
        self._lock = threading.Condition()
        self.answer: Callable[[Incoming], Message | None] = self._echo

    @staticmethod
    def _echo(incoming: Incoming) -> Message | None:
        body = incoming.body
        return Pong(body.payload) if isinstance(body, Ping) else None

    def __call__(self, incoming: Incoming) -> Message | None:
        with self._lock:
            self.calls.append(incoming)
            self._lock.notify_all()
        self.called.set()
        return self.answer(incoming)

    def wait_count(self, count: int, timeout: float = WAIT) -> bool:
        """Wait until the handler has been called ``count`` times."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self.calls) >= count, timeout)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.calls)

    def payloads(self) -> list[Any]:
        with self._lock:
            return [c.body.payload for c in self.calls if isinstance(c.body, Ping)]


class SecureNode:
    """A SecureListener served by a Server on loopback (real ZeroMQ)."""

    def __init__(self, ctx: zmq.Context, cfg: PMetalConfig, namespace: NetworkNamespace,
                 address: str = LOOPBACK, identity: NodeIdentity | None = None) -> None:
        self.config = cfg
        self.namespace = namespace
        self.transport = ZmqTransport(cfg.transport, ctx, curve=namespace.curve_keys())
        self.identity = identity or NodeIdentity.generate()
        self.listener = SecureListener(self.transport.listen(address), self.identity,
                                       namespace, cfg)
        self.handler = Recorder()
        self.server = Server(self.listener, self.handler).start()
        self._stopped = False

    @property
    def address(self) -> str:
        return self.listener.address

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.server.stop(timeout=WAIT)


@pytest.fixture
def make_node(zmq_context: zmq.Context, namespace: NetworkNamespace
              ) -> Iterator[Callable[..., SecureNode]]:
    """``make_node(cfg=None, namespace=None, address=LOOPBACK, identity=None)``."""
    nodes: list[SecureNode] = []

    def make(cfg: PMetalConfig | None = None, ns: NetworkNamespace | None = None,
             address: str = LOOPBACK, identity: NodeIdentity | None = None) -> SecureNode:
        node = SecureNode(zmq_context, cfg or make_config(), ns or namespace, address,
                          identity)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop()


@pytest.fixture
def make_channel(zmq_context: zmq.Context, namespace: NetworkNamespace
                 ) -> Iterator[Callable[..., Channel]]:
    """``make_channel(address, cfg=None, ns=None, identity=None)``: an
    unopened Channel over real ZeroMQ, closed at teardown."""
    channels: list[Channel] = []

    def make(address: str, cfg: PMetalConfig | None = None, ns: NetworkNamespace | None = None,
             identity: NodeIdentity | None = None) -> Channel:
        cfg = cfg or make_config()
        ns = ns or namespace
        dialer = ZmqTransport(cfg.transport, zmq_context, curve=ns.curve_keys()).dial(address)
        channel = Channel(dialer, identity or NodeIdentity.generate(), ns, cfg)
        channels.append(channel)
        return channel

    yield make
    for channel in channels:
        channel.close()


# ------------------------------------------------------------ the session

def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile pmetal and these test helpers once, into the usual
    (git-ignored) ``__pycache__`` folders, before any test starts a process.

    The suite starts hundreds of Python processes (nodes, drivers, ranks,
    ``pmetal`` commands). Where ``PYTHONDONTWRITEBYTECODE`` is set (common in
    container images, and on this project's machines) none of them writes
    the bytecode it compiles, so each compiled pmetal from source again:
    ~0.4 s of CPU per process (``import pmetal.node.daemon``: 0.9 s instead
    of 0.35 s). Compiling once takes ~0.5 s, and is a no-op when the
    bytecode is current. Imports in the test process itself are unchanged
    (pytest rewrites the test modules its own way)."""
    import compileall
    root = Path(__file__).resolve().parents[1]
    for folder in (root / "pmetal", root / "tests"):
        compileall.compile_dir(folder, quiet=2)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """Collect with the cyclic garbage collector off, then move everything
    collection made (modules, rewritten test code, ~4,000 items: ~230,000
    objects that live as long as the session) to the permanent generation.

    Collecting imports every test module through pytest's assertion
    rewriter, which makes objects faster than anything frees them: the
    collector ran ~26 full collections over a growing heap, 2.2-2.6 s of
    the ~8 s of CPU collection took; with it off, one collection at the
    end (0.5 s) and the same peak memory (165 MB). Frozen, those objects
    are no longer scanned by the full collections of the test process
    during the run (a plain ``gc.collect()`` late in a full run took 0.4 s;
    see test_transport_zmq). Objects the tests make are collected as
    before; ``gc.get_objects()`` lists only those (the leak tests compare
    counts between rounds).

    Hypothesis is imported before the freeze: at import it registers the
    random generators of the libraries present (trio's), and checks with
    ``gc.get_referrers``, which does not search frozen objects, that each
    is referenced (it warned otherwise)."""
    gc.disable()
    try:
        yield
    finally:
        try:
            import hypothesis  # noqa: F401 - see above
        except ImportError:
            pass
        gc.collect()
        gc.freeze()
        gc.enable()


# -------------------------------------------------------- raw ZeroMQ peers

def raw_dealer(ctx: zmq.Context, address: str, *, routing_id: bytes | None = None,
               curve: CurveKeys | None = TEST_NAMESPACE.curve_keys(),
               **options: int) -> zmq.Socket:
    """A bare DEALER, as an attacker would open one: no pmetal code involved.
    ``curve``: the namespace's transport keys (by default those of the test
    namespace: an attacker who holds the PSK; None: a stranger). Sends and
    receives time out after :data:`WAIT` unless told otherwise."""
    sock = ctx.socket(zmq.DEALER)
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(WAIT * 1000))
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def recv_reply(sock: zmq.Socket) -> Message:
    """The next unsealed reply on a raw DEALER (waits at most its RCVTIMEO)."""
    return decode(sock.recv_multipart()).body


def raw_handshake(sock: zmq.Socket, identity: NodeIdentity, namespace: NetworkNamespace,
                  mode: int = Mode.FULL, host: bytes | None = None) -> Session:
    """Run the client handshake by hand over a raw DEALER; return the session.
    ``host`` replaces the host id the client claims (another machine's)."""
    state = client_hello(identity, namespace, mode, prove_host=True)
    if host is not None:
        state.hello = dataclasses.replace(state.hello, host=host)
    sock.send_multipart(encode(state.hello, sender=identity.node_id))
    welcome = recv_reply(sock)
    if isinstance(welcome, Rejected):
        raise HandshakeError(welcome.reason)
    assert isinstance(welcome, Welcome), welcome
    confirm, session = client_finish(identity, namespace, state, welcome, mode)
    assert isinstance(confirm, Confirm)
    sock.send_multipart(encode(confirm, sender=identity.node_id))
    accepted = session.open(sock.recv_multipart())
    assert decode(accepted).body.node_id == session.peer
    return session


def error_text(body: Message) -> str:
    """A readable description of an unexpected reply, for assertion messages."""
    if isinstance(body, ErrorReply):
        return f"{body.error_type}: {body.message}\n{body.traceback}"
    return repr(body)


def shm_objects() -> set[str]:
    """Names of the shared-memory objects this process's pmetal code made."""
    return {name[1:] for name in shm.objects(creators=(os.getpid(),))}


# ------------------------------------------------------- network namespaces

from netlab import netlab  # noqa: E402,F401 - the fixture, for tests/cluster
