"""A borrower that dies without releasing: its owner drops its counts once
its lease lapses (``actors.borrower_lease``, shortened here to 1 s), and
not while it lives."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

import pmetal
from pmetal.actors import context
from pmetal.config import load_config

from .conftest import WAIT, pid_alive, shutdown_quietly, wait_until
from .ownership_classes import Holder

LEASE = 1.0


@pytest.fixture(scope="module")
def short_lease() -> Iterator[None]:
    if pmetal.is_initialized():
        shutdown_quietly()
    # The embedded node and its workers run with the driver's config.
    pmetal.init(num_workers=1, config=load_config(actors={"borrower_lease": LEASE}))
    try:
        yield
    finally:
        shutdown_quietly()


def test_a_dead_borrowers_counts_lapse_and_a_live_ones_do_not(short_lease: None) -> None:
    objects = context.current().objects
    before = len(objects.owned)
    holder = Holder.remote()
    pid = pmetal.get(holder.pid.remote(), timeout=WAIT)
    refs = [pmetal.put(i) for i in range(10)]
    assert pmetal.get(holder.keep.remote(refs), timeout=WAIT) == 10
    del refs
    assert pmetal.get(holder.resolve_kept.remote(), timeout=WAIT) == list(range(10))
    # Alive, it renews its lease: two leases pass and the objects stay.
    assert not objects.owned.wait_empty(2 * LEASE, left=before)
    assert len(objects.owned) == before + 10
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), WAIT, what=f"exit of worker {pid}")
    assert objects.owned.wait_empty(WAIT, left=before), objects.statistics()
    assert objects.statistics().lapsed >= 1
