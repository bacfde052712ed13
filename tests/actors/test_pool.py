"""The worker pool survives an operating system that refuses to start a worker.

Running out of processes, memory or descriptors cannot be caused for real
here without harming the machine (root ignores RLIMIT_NPROC), so the failure
is injected at the one call that starts a process; everything else is the
real pool in a real event loop.
"""

from __future__ import annotations

import asyncio
import errno
import time

import pytest

from pmetal.node.pool import WorkerPool
from pmetal.config import load_config
from pmetal.errors import PMetalTimeoutError
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport


class RefusingPool(WorkerPool):
    async def _start(self, worker_id: str):  # type: ignore[override]
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")


def test_a_refused_worker_start_is_counted_and_the_pool_lives_on() -> None:
    async def scenario() -> tuple[object, BaseException | None]:
        config = load_config(env={}, transport={"connect_timeout": 1.0})
        exited: list[object] = []

        async def on_exit(worker: object, code: int) -> None:
            exited.append(worker)

        pool = RefusingPool(node_id="n" * 16, host="127.0.0.1", identity=NodeIdentity.generate(),
                            namespace=NetworkNamespace.generate("default"), config=config,
                            transport=ZmqTransport(config.transport), num_actor=2, num_task=1,
                            on_exit=on_exit)
        stopping = asyncio.Event()
        failure: BaseException | None = None
        async with asyncio.TaskGroup() as group:
            pool.start(group, "tcp://127.0.0.1:1", stopping)
            pool.spawn("actor")
            pool.spawn("task")
            try:
                await pool.take_idle(time.monotonic() + 0.5)
            except PMetalTimeoutError as exc:
                failure = exc
            stopping.set()
        pool.close()
        return pool.statistics(), failure

    stats, failure = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert stats.spawn_failures >= 2
    assert stats.workers == 0 and stats.starting == 0
    assert isinstance(failure, PMetalTimeoutError) and "overloaded" in str(failure)
