"""No leak: 100,000 ObjectRefs passed through three processes (the driver
that owns them and two actors that borrow them), round after round, leave
every ownership table empty and every process's memory flat."""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest

import pmetal
from pmetal.actors import context

from .conftest import shared_memory_objects
from .ownership_classes import Holder, rss

NUM_WORKERS = 2
REFS = 100_000
ROUNDS = 3
BIG_WAIT = 60.0   # 100,000 refs each way on a loaded 2-core machine

pytestmark = pytest.mark.usefixtures("cluster")


def test_100k_refs_through_three_processes_are_all_freed(reap: list) -> None:
    a, b = Holder.remote(), Holder.remote()
    reap.extend([a, b])
    objects = context.current().objects
    before = len(objects.owned)
    sizes, counts, blocks = [], [], []
    for _ in range(ROUNDS):
        refs = [pmetal.put(i) for i in range(REFS)]
        # driver -> a (borrows them) -> b (keeps them); a lets go at once.
        assert pmetal.get(a.pass_on.remote(refs, b, BIG_WAIT), timeout=BIG_WAIT) == REFS
        assert len(objects.owned) == before + REFS
        del refs
        pmetal.get(b.drop.remote(), timeout=BIG_WAIT)
        tables = pmetal.get([a.ownership.remote(), b.ownership.remote()], timeout=BIG_WAIT)
        assert [t["borrowed"] for t in tables] == [0, 0]
        assert objects.owned.wait_empty(BIG_WAIT, left=before), objects.statistics()
        gc.collect()
        sizes.append([rss(), *(t["rss"] for t in tables)])
        counts.append([len(gc.get_objects()), *(t["objects"] for t in tables)])
        blocks.append([sys.getallocatedblocks(), *(t["blocks"] for t in tables)])
    stats = objects.statistics()
    assert stats.freed >= ROUNDS * REFS and stats.stale == 0
    # Large arrays among them travel in shared memory on one machine: none
    # is left behind by any of the three processes.
    arrays = [pmetal.put(np.full(1 << 20, i, dtype=np.float64)) for i in range(3)]
    assert pmetal.get(a.pass_on.remote(arrays, b, BIG_WAIT), timeout=BIG_WAIT) == 3
    assert [float(x[0]) for x in pmetal.get(b.resolve_kept.remote(), timeout=BIG_WAIT)] == [
        0.0, 1.0, 2.0]
    del arrays
    pmetal.get(b.drop.remote(), timeout=BIG_WAIT)
    pids = [os.getpid(), *pmetal.get([a.pid.remote(), b.pid.remote()], timeout=BIG_WAIT)]
    assert objects.owned.wait_empty(BIG_WAIT, left=before), objects.statistics()
    assert shared_memory_objects(*pids) == []
    # No object survives a round: after the first (which makes what a
    # process makes once: sockets, threads, lazily imported modules) the
    # garbage collector's count of objects stays put: one leaked ref per 200
    # passed would show (500 objects), while a worker under load may make a
    # hundred of its own in a round (measured 114 beside CPU hogs: a timer, a
    # reconnect), which a bound of 100 took for a leak.
    assert all(abs(c - f) < 500 for f, c in zip(counts[-2], counts[-1])), counts
    # Memory flat. Python's allocator: the blocks it holds stay put (100,000
    # leaked refs would hold 200,000 blocks and more: a ref, its value or
    # weak reference, table entries). The process: RSS moves by up to 20 MB
    # from round to round here (arenas, sockets' buffers, a busy machine),
    # but does not keep growing: the last round stays within 24 MB of the
    # highest before it.
    print(f"\n[leak] allocated blocks after each round: {blocks}; RSS (MiB): "
          f"{[[x >> 20 for x in row] for row in sizes]}")
    grown_blocks = [last - prev for prev, last in zip(blocks[-2], blocks[-1])]
    assert all(g < 20_000 for g in grown_blocks), f"allocated blocks per round: {blocks}"
    grown = [sizes[-1][i] - max(row[i] for row in sizes[:-1]) for i in range(3)]
    assert all(g < 24 << 20 for g in grown), f"RSS after each round (bytes): {sizes}"
