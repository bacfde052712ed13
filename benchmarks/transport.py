"""Transport suite: pmetal's authenticated transport against raw pyzmq.

Measures, in one sitting and interleaved so that a noisy machine hurts both
sides alike:

* small-message round trip (median, p99), one call at a time;
* pipelined small messages per second (10,000 sent, then 10,000 replies read);
* bulk throughput of a 1 MiB and a 64 MiB float32 array sent to a server that
  acknowledges it.

Systems: raw pyzmq DEALER/ROUTER with msgpack (the floor; the same pattern as
../shared/anchors/bench_zmq.py), the same with ZeroMQ's CURVE mechanism (what
every pmetal socket runs, to keep strangers out of libzmq's buffers), and
pmetal in each security mode: ``control``
(bulk_auth off), ``auth`` (default: everything authenticated) and
``encrypt`` (ChaCha20-Poly1305). The servers run in their own processes.
Shared memory (the same-host path for large arrays) is turned off here so
that the bulk figures are those of the socket path; the actors suite
measures the same-host path.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq

from benchmarks.common import cpu_per_call, median, pct, table

MiB = 1 << 20
MODES = {"control": {"bulk_auth": False}, "auth": {}, "encrypt": {"encrypt": True}}
PSK = b"benchmark-psk-not-secret-0123456789"
# Both ends run on this host, where arrays would go through shared memory:
# this suite measures the socket path, which is what crosses a network.
SOCKET_ONLY = {"shm_min_bytes": 0}


# ------------------------------------------------------------------ servers

def _curve() -> Any:
    from pmetal.security import NetworkNamespace
    return NetworkNamespace("bench", PSK).curve_keys()


def _raw_server(conn: Any, curve: bool = False) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if curve:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, _curve().server_secret)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    while True:
        ident = sock.recv()
        msg = msgpack.unpackb(sock.recv())
        if msg["m"] == "bulk":
            # Reassemble into one array, as a real receiver must.
            out = np.empty(msg["a"][0], np.uint8)
            view = memoryview(out)
            off = 0
            while sock.getsockopt(zmq.RCVMORE):
                frame = sock.recv(copy=False).buffer
                view[off:off + len(frame)] = frame
                off += len(frame)
            reply = off
        else:
            reply = msg["a"][0]
        sock.send_multipart([ident, msgpack.packb({"id": msg["id"], "r": reply})])
        if msg["m"] == "stop":
            return


def _pmetal_server(conn: Any, security: dict[str, Any]) -> None:
    from pmetal.config import load_config
    from pmetal.endpoint import SecureListener, Server
    from pmetal.identity import NodeIdentity
    from pmetal.security import NetworkNamespace
    from pmetal.transport import ZmqTransport
    from pmetal.wire import Pong

    cfg = load_config(env={}, security=security, transport=SOCKET_ONLY)
    listener = SecureListener(ZmqTransport(cfg.transport, curve=_curve()).listen("tcp://127.0.0.1:0"),
                              NodeIdentity.generate(), NetworkNamespace("bench", PSK), cfg)
    conn.send(listener.address)

    def handle(incoming: Any) -> Any:
        payload = incoming.body.payload
        if isinstance(payload, np.ndarray):
            return Pong(payload.nbytes)
        return Pong(payload)

    Server(listener, handle)._run()


# ------------------------------------------------------------------ clients

class RawClient:
    def __init__(self, address: str, curve: bool = False) -> None:
        self.name = "raw pyzmq curve" if curve else "raw pyzmq"
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        if curve:
            keys = _curve()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.n = 0

    def call(self) -> None:
        self.n += 1
        self.sock.send(msgpack.packb({"id": self.n, "m": "f", "a": [1]}))
        msgpack.unpackb(self.sock.recv())

    def pipelined(self, count: int) -> None:
        for i in range(count):
            self.sock.send(msgpack.packb({"id": i, "m": "f", "a": [1]}))
        for _ in range(count):
            msgpack.unpackb(self.sock.recv())

    def bulk(self, arr: np.ndarray) -> None:
        flat = memoryview(arr.reshape(-1)).cast("B")
        chunks = [flat[o:o + MiB] for o in range(0, len(flat), MiB)]
        self.sock.send_multipart([msgpack.packb({"id": 0, "m": "bulk", "a": [arr.nbytes]}),
                                  *chunks], copy=False)
        assert msgpack.unpackb(self.sock.recv())["r"] == arr.nbytes

    def close(self) -> None:
        self.sock.close()


class PMetalClient:
    def __init__(self, address: str, mode: str) -> None:
        from pmetal.config import load_config
        from pmetal.endpoint import Channel
        from pmetal.identity import NodeIdentity
        from pmetal.security import NetworkNamespace
        from pmetal.transport import ZmqTransport
        from pmetal.wire import Ping

        self.name = f"pmetal {mode}"
        cfg = load_config(env={}, security=MODES[mode], transport=SOCKET_ONLY)
        self.channel = Channel(ZmqTransport(cfg.transport, curve=_curve()).dial(address),
                               NodeIdentity.generate(), NetworkNamespace("bench", PSK), cfg)
        self.channel.open(timeout=10)
        self.Ping = Ping

    def call(self) -> None:
        self.channel.request(self.Ping(1), timeout=10)

    def pipelined(self, count: int) -> None:
        ping = self.Ping(1)
        corrs = [self.channel.submit(ping) for _ in range(count)]
        for c in corrs:
            self.channel.result(c, timeout=30)

    def bulk(self, arr: np.ndarray) -> None:
        reply = self.channel.request(self.Ping(arr), timeout=60)
        assert reply.body.payload == arr.nbytes

    def close(self) -> None:
        self.channel.close()


# ------------------------------------------------------------------ driver

def _start(target: Callable[..., None], *args: Any) -> tuple[Any, str]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(30):
        proc.kill()
        raise RuntimeError("benchmark server did not start within 30 s")
    return proc, parent.recv()


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(quick: bool = False) -> dict[str, dict[str, float]]:
    rounds, calls, pipe_n, pipe_rounds = (2, 300, 2000, 1) if quick else (7, 1000, 10_000, 3)
    bulk_reps = {1 * MiB: 10 if quick else 60, 64 * MiB: 2 if quick else 9}

    procs = []
    clients: list[Any] = []
    for curve in (False, True):
        proc, addr = _start(_raw_server, curve)
        procs.append(proc)
        clients.append(RawClient(addr, curve))
    for mode, security in MODES.items():
        proc, addr = _start(_pmetal_server, security)
        procs.append(proc)
        clients.append(PMetalClient(addr, mode))
    try:
        rtt: dict[str, list[float]] = {c.name: [] for c in clients}
        pipe: dict[str, list[float]] = {c.name: [] for c in clients}
        bulk: dict[tuple[str, int], list[float]] = {}
        for c in clients:  # warm up connections, caches, allocators
            for _ in range(200):
                c.call()
        for _ in range(rounds):
            for c in clients:
                for _ in range(calls):
                    rtt[c.name].append(_timed(c.call))
        cpu = {}
        if os.path.isdir("/proc/self/task"):
            for c, p in zip(clients, procs):
                if c.name in ("raw pyzmq", "pmetal auth"):
                    cpu[c.name] = cpu_per_call(c.call, {"client": os.getpid(), "server": p.pid},
                                               2000 if quick else 10_000)
        for _ in range(pipe_rounds):
            for c in clients:
                pipe[c.name].append(pipe_n / _timed(lambda: c.pipelined(pipe_n)))
        for size, reps in bulk_reps.items():
            arr = np.random.default_rng(0).random(size // 4, dtype=np.float32)
            for c in clients:
                c.bulk(arr)
            for _ in range(reps):
                for c in clients:
                    bulk.setdefault((c.name, size), []).append(size / _timed(lambda: c.bulk(arr)))
    finally:
        for c in clients:
            c.close()
        for p in procs:
            p.kill()
            p.join(5)

    results: dict[str, dict[str, float]] = {}
    rows = []
    for c in clients:
        r = {
            "rtt_us": median(rtt[c.name]) * 1e6,
            "rtt_p99_us": pct(rtt[c.name], 0.99) * 1e6,
            "pipelined_per_s": median(pipe[c.name]),
            "bulk_1mib_gbs": median(bulk[(c.name, MiB)]) / 1e9,
            "bulk_64mib_gbs": median(bulk[(c.name, 64 * MiB)]) / 1e9,
        }
        results[c.name] = r
        rows.append([c.name, r["rtt_us"], r["rtt_p99_us"], int(r["pipelined_per_s"]),
                     r["bulk_1mib_gbs"], r["bulk_64mib_gbs"]])
    print(table("transport: one client, one server process, TCP loopback",
                ["system", "round trip median (us)", "p99 (us)", "pipelined msgs/s",
                 "1 MiB GB/s", "64 MiB GB/s"], rows))
    if cpu:
        keys = list(dict.fromkeys(k for use in cpu.values() for k in use))
        print(table("small round trip: CPU per round trip by thread (us, /proc)",
                    ["process: thread", *cpu],
                    [*([k, *(cpu[n].get(k, 0.0) for n in cpu)] for k in keys),
                     ["total", *(sum(use.values()) for use in cpu.values())]]))
    raw, auth, control = results["raw pyzmq"], results["pmetal auth"], results["pmetal control"]
    print(table("transport targets (issue 1)", ["target", "measured", "goal", "met"], [
        ["authenticated round trip / raw pyzmq", f"{auth['rtt_us'] / raw['rtt_us']:.2f}x",
         "<= 1.5x", _ok(auth["rtt_us"] / raw["rtt_us"] <= 1.5)],
        ["pipelined authenticated msgs/s", f"{auth['pipelined_per_s']:,.0f}", ">= 15,000",
         _ok(auth["pipelined_per_s"] >= 15_000)],
        ["64 MiB auth on / auth off", f"{auth['bulk_64mib_gbs'] / control['bulk_64mib_gbs']:.0%}",
         ">= 70%", _ok(auth["bulk_64mib_gbs"] / control["bulk_64mib_gbs"] >= 0.7)],
    ]))
    return results


def _ok(flag: bool) -> str:
    return "yes" if flag else "NO"
