"""Actors of the telemetry tests (tests/actors/test_metrics_telemetry.py):
workers import them by reference."""

from __future__ import annotations

from typing import Any

import numpy as np

import pmetal
from pmetal import collective


@pmetal.remote
class Member:
    """A member of a collective group that reduces what the test asks."""

    def all_reduce(self, name: str, n: int, strategy: str) -> float:
        group = collective.get_group(name)
        x = np.ones(n, np.float64)
        group.all_reduce(x, strategy=strategy)
        return float(x[0])


@pmetal.remote
class Lender:
    """Owns an object and lends it: the caller borrows what :meth:`lend`
    returns (a ref inside a list)."""

    def lend(self) -> list[Any]:
        self.kept = pmetal.put(np.arange(4))
        return [self.kept]
