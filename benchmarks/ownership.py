"""ObjectRefs inside values (Ray's ownership model), on this machine:

* a call whose argument holds one ref the actor resolves (the actor fetches
  the value from the driver's object server), beside the same call with the
  value itself: what a nested ref costs;
* a 64 MiB float32 array fetched by an actor from its owner (the driver),
  beside the same array sent as an argument;
* a get of 10,000 refs of the driver in an actor (fetched a window of 1,000
  ahead);
* 100,000 refs lent by the driver to an actor, which passes them to a
  second actor, and all of them released again until the driver's table is
  empty: refs per second, per round.

Opt-in: ``python -m benchmarks ownership``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np

from benchmarks.common import median, table

MiB = 1 << 20


def main(quick: bool = False) -> dict[str, float]:
    import pmetal
    from pmetal.actors import context

    @pmetal.remote
    class Holder:
        def value(self, x: Any) -> Any:
            return x

        def first(self, xs: list[Any]) -> Any:
            return pmetal.get(xs[0])

        def nbytes(self, a: np.ndarray) -> int:
            return int(a.nbytes)

        def get_all(self, xs: list[Any]) -> float:
            t = time.perf_counter()
            pmetal.get(xs)
            return len(xs) / (time.perf_counter() - t)

        def nbytes_of(self, xs: list[Any]) -> int:
            return int(pmetal.get(xs[0]).nbytes)

        def keep(self, xs: list[Any]) -> int:
            self.kept = xs
            return len(xs)

        def pass_on(self, xs: list[Any], other: Any) -> int:
            return pmetal.get(other.keep.remote(xs), timeout=120)

        def drop(self) -> None:
            self.kept = None

        def settled(self) -> bool:
            gc.collect()
            return context.current().objects.settled(60)

    calls, reps, n_refs, rounds = (200, 3, 20_000, 2) if quick else (1000, 7, 100_000, 3)
    pmetal.init(num_workers=2)
    try:
        a, b = Holder.remote(), Holder.remote()
        pmetal.get([a.value.remote(1), b.value.remote(1)], timeout=60)
        plain, nested = [], []
        for _ in range(calls):
            t = time.perf_counter()
            pmetal.get(a.value.remote([1]))
            plain.append(time.perf_counter() - t)
            ref = pmetal.put(1)
            t = time.perf_counter()
            pmetal.get(a.first.remote([ref]))
            nested.append(time.perf_counter() - t)
        arr = np.random.default_rng(0).random(64 * MiB // 4, dtype=np.float32)
        pmetal.get([a.nbytes.remote(arr), a.nbytes_of.remote([pmetal.put(arr)])], timeout=60)
        sent, fetched = [], []
        for _ in range(reps):
            t = time.perf_counter()
            pmetal.get(a.nbytes.remote(arr), timeout=60)
            sent.append(arr.nbytes / (time.perf_counter() - t))
            ref = pmetal.put(arr)
            t = time.perf_counter()
            pmetal.get(a.nbytes_of.remote([ref]), timeout=60)
            fetched.append(arr.nbytes / (time.perf_counter() - t))
        many = [pmetal.get(a.get_all.remote([pmetal.put(i) for i in range(n_refs // 10)]),
                           timeout=120) for _ in range(reps)]
        owned = context.current().objects.owned
        lent = []
        for _ in range(rounds):
            before = len(owned)
            refs = [pmetal.put(i) for i in range(n_refs)]
            t = time.perf_counter()
            pmetal.get(a.pass_on.remote(refs, b), timeout=120)
            del refs
            pmetal.get(b.drop.remote(), timeout=120)
            pmetal.get([a.settled.remote(), b.settled.remote()], timeout=120)
            owned.wait_empty(120, left=before)
            lent.append(n_refs / (time.perf_counter() - t))
    finally:
        pmetal.shutdown()
    out = {"plain_us": median(plain) * 1e6, "nested_us": median(nested) * 1e6,
           "sent_gbs": median(sent) / 1e9, "fetched_gbs": median(fetched) / 1e9,
           "refs_per_s": median(lent), "fetched_per_s": median(many)}
    print(table("ObjectRefs inside values (python -m benchmarks ownership)", ["measure", "pmetal"], [
        ["call with [1], the actor returns it (us, median)", out["plain_us"]],
        ["call with [ref], the actor gets it from the driver (us, median)", out["nested_us"]],
        ["64 MiB array as an argument (GB/s)", out["sent_gbs"]],
        ["64 MiB array fetched by the actor from its owner (GB/s)", out["fetched_gbs"]],
        [f"get of {n_refs // 10:,} borrowed refs in an actor (refs/s)", out["fetched_per_s"]],
        [f"{n_refs:,} refs driver -> actor -> actor and released (refs/s)", out["refs_per_s"]],
    ]))
    return out
