"""Instruction-count suite: CPU instructions per small-message round trip.

Timings on a shared 2-core machine move by 10-20% between sittings;
instruction counts do not. Under ``valgrind --tool=callgrind`` one process
runs a request/reply loop over TCP loopback with both ends in it (ZeroMQ's
I/O thread included): pmetal's Channel and SecureListener in the default
security mode, and raw pyzmq DEALER/ROUTER with msgpack as the floor. Each
loop runs twice (1,000 and 3,000 round trips); the difference divided by
2,000 is the cost of one round trip without start-up.

Opt-in (about a minute): ``python -m benchmarks instructions``. Needs
valgrind (Debian package ``valgrind``); without it the suite says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap

from benchmarks.common import table

PMETAL_LOOP = textwrap.dedent("""
    import sys, threading, time
    from pmetal.config import load_config
    from pmetal.errors import PMetalTimeoutError
    from pmetal.endpoint import Channel, SecureListener
    from pmetal.identity import NodeIdentity
    from pmetal.security import NetworkNamespace
    from pmetal.transport import ZmqTransport
    from pmetal.wire import Ping, Pong

    cfg = load_config(env={}, transport={"shm_min_bytes": 0})
    ns = NetworkNamespace("bench", b"benchmark-psk-not-secret-0123456789")
    transport = ZmqTransport(cfg.transport)
    listener = SecureListener(transport.listen("tcp://127.0.0.1:0"), NodeIdentity.generate(),
                              ns, cfg)
    channel = Channel(transport.dial(listener.address), NodeIdentity.generate(), ns, cfg)
    opener = threading.Thread(target=channel.open, kwargs={"timeout": 60})
    opener.start()
    deadline = time.monotonic() + 60
    while opener.is_alive() and time.monotonic() < deadline:
        try:
            listener.recv(timeout=0.2)   # serves the handshake; no request comes
        except PMetalTimeoutError:
            pass
    opener.join(1)
    ping = Ping(1)
    for _ in range(int(sys.argv[1])):
        corr = channel.submit(ping)
        incoming = listener.recv(60)
        listener.reply(incoming, Pong(incoming.body.payload))
        channel.result(corr, 60)
""")

RAW_LOOP = textwrap.dedent("""
    import sys, msgpack, zmq
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    for i in range(int(sys.argv[1])):
        dealer.send(msgpack.packb({"id": i, "m": "f", "a": [1]}))
        ident = router.recv()
        msg = msgpack.unpackb(router.recv())
        router.send_multipart([ident, msgpack.packb({"id": msg["id"], "r": msg["a"][0]})])
        msgpack.unpackb(dealer.recv())
""")

SHORT, LONG = 1000, 3000


def _instructions(script: str, rounds: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", script, str(rounds)],
        capture_output=True, text=True, timeout=600, check=True)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"valgrind printed no instruction count:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_round_trip(script: str) -> float:
    return (_instructions(script, LONG) - _instructions(script, SHORT)) / (LONG - SHORT)


def main(quick: bool = False) -> dict[str, float]:
    if shutil.which("valgrind") is None:
        print("\n### instructions\n\nvalgrind is not installed (apt install valgrind): skipped")
        return {}
    raw = per_round_trip(RAW_LOOP)
    pmetal = per_round_trip(PMETAL_LOOP)
    print(table("instructions per small-message round trip (callgrind, both ends in one "
                "process)", ["system", "instructions", "ratio"],
                [["raw pyzmq + msgpack", int(raw), 1.0],
                 ["pmetal auth", int(pmetal), pmetal / raw]]))
    return {"raw": raw, "pmetal": pmetal}
