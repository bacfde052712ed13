"""``pmetal bench seal``: what sealing a link (:mod:`pmetal.links.seal`)
costs on this machine, and why it is AES-256-GCM.

Tables:

(a) **the two AEADs** ``cryptography`` offers for it, AES-256-GCM and
    ChaCha20-Poly1305, on one core (``encrypt_into`` and ``decrypt_into``
    into preallocated buffers, as the links call them): microseconds per
    call and GB/s, for a pipeline hop of 2.3 KB (SmolLM2-135M's float32
    activation row), a sealed segment (256 KiB) and 1 MiB. Median of 7
    runs, each timing enough calls to last about 20 ms.
(b) **one TCP link** over 127.0.0.1 between two threads of this process,
    in clear and sealed: ``--bytes`` sent as messages of ``--message``
    bytes (the ring's chunk), received into a preallocated array and
    checked. Median of ``--repeats`` runs.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

__all__ = ["aead_rows", "link_rows", "run"]

HOP = 2304
_NONCE = bytes(12)


def _timed(call: Callable[[], None], runs: int = 7) -> float:
    """Median seconds per call over ``runs`` runs of about 20 ms each."""
    began, n = time.perf_counter(), 0
    while time.perf_counter() - began < 0.02:
        call()
        n += 1
    per = []
    for _ in range(runs):
        began = time.perf_counter()
        for _ in range(n):
            call()
        per.append((time.perf_counter() - began) / n)
    return statistics.median(per)


def aead_rows(sizes: Sequence[int]) -> list[list[str]]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    rows = []
    for name, cls in (("AES-256-GCM", AESGCM), ("ChaCha20-Poly1305", ChaCha20Poly1305)):
        aead = cls(os.urandom(32))
        for size in sizes:
            plain, sealed, back = bytearray(os.urandom(size)), bytearray(size + 16), \
                bytearray(size)
            aead.encrypt_into(_NONCE, plain, None, sealed)
            seal = _timed(lambda a=aead, p=plain, s=sealed: a.encrypt_into(_NONCE, p, None, s))
            opened = _timed(lambda a=aead, s=sealed, b=back: a.decrypt_into(_NONCE, s, None, b))
            rows.append([name, f"{size:,}", f"{seal * 1e6:.1f}", f"{opened * 1e6:.1f}",
                         f"{size / seal / 1e9:.2f}", f"{size / opened / 1e9:.2f}"])
    return rows


def _pair(seal: bool) -> tuple[object, object]:
    from pmetal.links import tcplinks

    listeners = [tcplinks.listen("127.0.0.1", 0) for _ in range(2)]
    addresses = [("127.0.0.1", s.getsockname()[1]) for s in listeners]
    tag = tcplinks.group_tag("bench-seal", 0, 1)
    out: dict[int, object] = {}
    deadline = time.monotonic() + 10.0

    def form(rank: int) -> None:
        out[rank] = tcplinks.connect_mesh(rank, addresses, listeners[rank], key=b"k" * 32,
                                          tag=tag, epoch=1, deadline=deadline, seal=seal)

    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15.0)
    for s in listeners:
        s.close()
    return out[0], out[1]


def _transfer(a: object, b: object, total: int, message: int) -> float:
    """Seconds to send ``total`` bytes from ``a`` to ``b`` in ``message``-byte
    messages, received into one array and checked."""
    import numpy as np

    from pmetal.links.tcplinks import P2P_BASE

    source = (np.arange(total, dtype=np.int64) % 251).astype(np.uint8)
    dest = np.zeros_like(source)
    count = total // message
    failure: list[BaseException] = []

    def send() -> None:
        try:
            for i in range(count):
                a.send(1, P2P_BASE + i, 0, source[i * message:(i + 1) * message])  # type: ignore[attr-defined]
                a.release(P2P_BASE + i)  # type: ignore[attr-defined]
        except BaseException as exc:  # noqa: BLE001 - raised below
            failure.append(exc)

    began = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    for i in range(count):
        b.recv(0, P2P_BASE + i, time.monotonic() + 30.0,  # type: ignore[attr-defined]
               dest[i * message:(i + 1) * message])
    elapsed = time.perf_counter() - began
    sender.join(30.0)
    if failure:
        raise failure[0]
    if not np.array_equal(source[:count * message], dest[:count * message]):
        raise AssertionError("bench seal: the bytes received differ from those sent")
    return elapsed


def link_rows(total: int, message: int, repeats: int) -> list[list[str]]:
    rows, times = [], {}
    for seal in (False, True):
        a, b = _pair(seal)
        try:
            _transfer(a, b, min(total, 4 * message), message)       # warm up
            times[seal] = statistics.median(_transfer(a, b, total, message)
                                            for _ in range(repeats))
        finally:
            a.close(timeout=1.0)  # type: ignore[attr-defined]
            b.close(timeout=1.0)  # type: ignore[attr-defined]
    for seal in (False, True):
        rows.append(["sealed" if seal else "clear", f"{total:,}", f"{message:,}",
                     f"{times[seal] * 1e3:.1f}", f"{total / times[seal] / 1e9:.2f}",
                     f"{times[seal] / times[False]:.2f}x"])
    return rows


def run(total: int = 64 << 20, message: int = 1 << 20, repeats: int = 5,
        sizes: Sequence[int] = (HOP, 256 << 10, 1 << 20), markdown: bool = False,
        out: TextIO | None = None) -> None:
    from pmetal.bench.report import _grid, _load

    stream = sys.stdout if out is None else out
    p = lambda *a: print(*a, file=stream, flush=True)
    heading = (lambda t: f"\n### {t}\n") if markdown else (lambda t: f"\n# {t}")
    p(heading("(a) the AEADs of cryptography, one core, into preallocated buffers"))
    p(_grid(["cipher", "bytes", "seal (us)", "open (us)", "seal GB/s", "open GB/s"],
            aead_rows(sizes), markdown, left=1))
    p(heading(f"(b) one TCP link over 127.0.0.1, two threads, {total:,} bytes in messages "
              f"of {message:,}, median of {repeats}"))
    p(_grid(["link", "bytes", "message", "time (ms)", "GB/s", "vs clear"],
            link_rows(total, message, repeats), markdown, left=1))
    p(f"\nload average at the end: {_load()}")
