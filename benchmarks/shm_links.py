"""Micro benchmark of the same-machine links (:mod:`pmetal.links.shmlinks`).

Two ranks in two processes run a 64 MiB float32 sum all-reduce written
directly on :class:`~pmetal.links.shmlinks.ShmLinks` (no executor, no
plan): reduce-scatter then all-gather over two halves, in pieces of
``--piece`` MiB so that one rank's copy into the ring overlaps the other's
reduction, each piece of the reduced half sent on as soon as it is reduced.
Prints busbw (nccl-tests' definition: algbw x 2(n-1)/n, so algbw for two
ranks), median of 5 after 2 warm-up runs, and the median 4 KiB round trip.
``--scratch`` receives reductions into a scratch buffer first, as the
executor does, instead of reducing from the ring in place; ``--executor``
runs the ring plan through :func:`pmetal.collectives.execute` instead (the
synchronous executor; ``--piece`` then sets the plan's sub-chunks).

    python -m benchmarks.shm_links [--mib 64] [--piece 2] [--ring 8] [--scratch | --executor]

Not part of the test suite; runs for a few seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

MiB = 1 << 20


def _rank(token: str, rank: int, args: dict[str, Any], results: Any) -> None:
    from pmetal.links.shmlinks import ShmLinks

    peer = 1 - rank
    links = ShmLinks.connect(token, rank, 2, deadline=time.monotonic() + 30,
                             ring_bytes=args["ring"] * MiB)
    n = args["mib"] * MiB // 4
    piece = args["piece"] * MiB // 4
    half = n // 2
    mine = (rank * half, rank * half + half)
    theirs = (peer * half, peer * half + half)
    x = np.empty(n, np.float32)
    scratch = np.empty(piece, np.float32)
    token_buf = np.zeros(1, np.float32)
    op = 0
    times = []
    wrong = 0
    plan = None
    if args["executor"]:
        from pmetal.collectives import ReduceOp, execute, make_plan
        plan = make_plan("all_reduce", "ring", 2, 0, n, pipeline_parts=max(1, half // piece))
    for it in range(7):
        x[:] = rank + 1 + it
        op += 1
        # barrier: both ranks start together
        links.send(peer, op, 0, token_buf)
        links.recv(peer, op, time.monotonic() + 30)
        links.release(op)
        op += 1
        t0 = time.perf_counter()
        deadline = time.monotonic() + 30
        if plan is not None:
            execute(plan, rank, x, links, op=ReduceOp.SUM, op_id=op, timeout=30)
            if it >= 2:
                times.append(time.perf_counter() - t0)
            wrong += int(np.count_nonzero(x != 3 + 2 * it))
            continue
        # reduce-scatter: send the peer's half, reduce ours; then pass each
        # reduced piece on at once (all-gather), receive the peer's into place
        for i, start in enumerate(range(theirs[0], theirs[1], piece)):
            links.send(peer, op, i, x[start:min(start + piece, theirs[1])])
        for i, start in enumerate(range(mine[0], mine[1], piece)):
            local = x[start:min(start + piece, mine[1])]
            if args["scratch"]:
                _, data = links.recv(peer, op, deadline, scratch[:local.size])
            else:
                _, data = links.recv(peer, op, deadline)
            np.add(local, data, out=local)
            links.send(peer, op, 1000 + i, local)
        for i, start in enumerate(range(theirs[0], theirs[1], piece)):
            local = x[start:min(start + piece, theirs[1])]
            links.recv(peer, op, deadline, local)
        links.release(op)
        elapsed = time.perf_counter() - t0
        if it >= 2:
            times.append(elapsed)
        wrong += int(np.count_nonzero(x != 3 + 2 * it))
    # 4 KiB round trips
    small = np.ones(1024, np.float32)
    buf = np.empty(1024, np.float32)
    rtts = []
    for i in range(2000):
        op += 1
        t0 = time.perf_counter()
        if rank == 0:
            links.send(1, op, 0, small)
            links.recv(1, op, time.monotonic() + 5, buf)
        else:
            links.recv(0, op, time.monotonic() + 5, buf)
            links.send(0, op, 0, small)
        rtts.append(time.perf_counter() - t0)
        links.release(op)
    links.close()
    results.put((rank, times, wrong, rtts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--piece", type=int, default=2)
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--scratch", action="store_true")
    parser.add_argument("--executor", action="store_true")
    args = vars(parser.parse_args())
    if args["executor"]:
        import inspect

        from pmetal.collectives import execute
        if inspect.iscoroutinefunction(execute):
            raise SystemExit("--executor needs the synchronous executor (issue 9, main 722cbc4)")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    token = os.urandom(16).hex()
    procs = [ctx.Process(target=_rank, args=(token, r, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    # an iteration lasts until the slower rank is done
    times = [max(a, b) for a, b in zip(got[0][1], got[1][1])]
    t = sorted(times)[len(times) // 2]
    size = args["mib"] * MiB
    rtt = sorted(got[0][3])[len(got[0][3]) // 2]
    print(f"all_reduce {args['mib']} MiB float32 sum, 2 ranks, piece {args['piece']} MiB, "
          f"ring {args['ring']} MiB{', scratch' if args['scratch'] else ''}"
          f"{', executor' if args['executor'] else ''}: "
          f"median {t * 1e3:.1f} ms, busbw {size / t / 1e9:.2f} GB/s "
          f"(runs {', '.join(f'{x * 1e3:.1f}' for x in times)} ms), "
          f"wrong {got[0][2] + got[1][2]}")
    print(f"4 KiB round trip: median {rtt * 1e6:.1f} us, "
          f"p99 {sorted(got[0][3])[int(len(got[0][3]) * 0.99)] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
