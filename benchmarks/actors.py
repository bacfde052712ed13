"""Actor-runtime suite: the figures a Ray user compares, against Ray itself
when it is installed (``pip install ray``), measured in the same sitting.

* cold start, as a user's fresh script sees it: a new process runs
  ``import pmetal`` (not timed), then ``init()``, creates an actor and waits
  for its first call (timed); the median over several fresh processes, with
  ``init()`` alone beside it;
* actor call round trip ``get(a.f.remote(1))`` (median, p99);
* pipelined actor calls: 10,000 submitted, then all gotten;
* remote function round trip ``get(f.remote(1))``;
* actor creation plus first call, with the worker pool warm (the node
  pre-starts workers; Ray's figure includes starting one);
* the same for the ninth actor of a driver that created eight back to back
  just before (more than the pool holds on a small machine: its worker is
  started for it);
* a 64 MiB float32 numpy array passed to an actor on this machine.

Ray's figures measured on this kind of machine (../shared/anchors) are printed
beside ours when Ray is not installed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import cpu_per_call, median, pct, table

MiB = 1 << 20

# ../shared/anchors/README.md, Ray 2.x on a 2-core machine like this one
# (bench_ray.py: init and the first actor each in a fresh process; every Ray
# actor starts a worker process, so its ninth costs what its first does).
RAY_ANCHOR = {"init_s": 6.7, "cold_start_s": 6.7 + 0.37, "rtt_us": 2375.0,
              "pipelined_per_s": 1174.0, "task_rtt_us": 6300.0, "create_first_call_ms": 400.0,
              "ninth_actor_ms": 400.0, "array_gbs": 1.65}

# Like the anchor: a fresh interpreter per run, the import not counted.
_COLD_PROBE = """
import time
import {mod}

@{mod}.remote
class A:
    def f(self):
        return 1

t0 = time.perf_counter()
{mod}.init({args})
t1 = time.perf_counter()
a = A.remote()
assert {mod}.get(a.f.remote(), timeout=60) == 1
t2 = time.perf_counter()
print(t1 - t0, t2 - t0)
{mod}.shutdown()
"""


def _cold_start(mod: str, args: str, runs: int) -> tuple[float, float]:
    """Medians of init() alone and of init() + creation + first call, each
    run in a fresh interpreter."""
    inits, totals = [], []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", _COLD_PROBE.format(mod=mod, args=args)],
                             capture_output=True, text=True, timeout=120, check=True)
        init, total = map(float, out.stdout.strip().splitlines()[-1].split())
        inits.append(init)
        totals.append(total)
    return median(inits), median(totals)


class Target:
    """The same workload written against pmetal or Ray (identical APIs)."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod
        remote = mod.remote

        @remote
        class Echo:
            def f(self, x: Any) -> Any:
                return x

            def nbytes(self, a: np.ndarray) -> int:
                return int(a.nbytes)

            def pid(self) -> int:
                return os.getpid()

            @mod.method(num_returns="streaming")
            def items(self, n: int) -> Any:
                for i in range(n):
                    yield i

        @remote
        def task(x: Any) -> Any:
            return x

        self.Echo = Echo
        self.task = task

    def _warm_pool(self) -> None:
        """Wait (untimed) until the node has an idle pre-started worker, so
        creation is measured as a user with a warm node sees it."""
        if self.mod.__name__ != "pmetal":
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            workers = self.mod.api.client().status()["workers"]
            if any(w["role"] == "actor" and not w["actor_id"] and w["ready"] for w in workers):
                return
            time.sleep(0.05)  # a benchmark pacing itself, not synchronisation in a test
        raise RuntimeError("the node did not refill its worker pool within 30 s")

    def measure(self, quick: bool) -> dict[str, float]:
        mod = self.mod
        calls, pipe_n, reps = (300, 2000, 3) if quick else (2000, 10_000, 7)
        actor = self.Echo.remote()
        mod.get(actor.f.remote(1), timeout=60)
        for _ in range(200):
            mod.get(actor.f.remote(1))
        rtt = []
        for _ in range(calls):
            t = time.perf_counter()
            mod.get(actor.f.remote(1))
            rtt.append(time.perf_counter() - t)
        pipe = []
        for _ in range(max(1, reps // 2)):
            t = time.perf_counter()
            mod.get([actor.f.remote(1) for _ in range(pipe_n)])
            pipe.append(pipe_n / (time.perf_counter() - t))
        mod.get(self.task.remote(1), timeout=60)
        task_rtt = []
        for _ in range(calls // 2):
            t = time.perf_counter()
            mod.get(self.task.remote(1))
            task_rtt.append(time.perf_counter() - t)
        create = []
        for _ in range(reps):
            self._warm_pool()
            t = time.perf_counter()
            a = self.Echo.remote()
            mod.get(a.f.remote(1), timeout=60)
            create.append(time.perf_counter() - t)
            mod.kill(a)
        ninth = []
        for _ in range(reps):
            self._warm_pool()
            # Eight created back to back take the pool's workers faster
            # than it refills: the ninth's worker is started for it.
            eight = [self.Echo.remote() for _ in range(8)]
            t = time.perf_counter()
            a = self.Echo.remote()
            mod.get(a.f.remote(1), timeout=60)
            ninth.append(time.perf_counter() - t)
            mod.get([e.f.remote(1) for e in eight], timeout=60)
            for e in [*eight, a]:
                mod.kill(e)
        arr = np.random.default_rng(0).random(64 * MiB // 4, dtype=np.float32)
        mod.get(actor.nbytes.remote(arr), timeout=60)
        array = []
        for _ in range(reps):
            t = time.perf_counter()
            assert mod.get(actor.nbytes.remote(arr), timeout=60) == arr.nbytes
            array.append(arr.nbytes / (time.perf_counter() - t))
        stream_n = 2000 if quick else 10_000
        stream = []
        for _ in range(max(1, reps // 2)):
            t = time.perf_counter()
            for ref in actor.items.remote(stream_n):
                mod.get(ref)
            stream.append(stream_n / (time.perf_counter() - t))
        out = {"rtt_us": median(rtt) * 1e6, "rtt_p99_us": pct(rtt, 0.99) * 1e6,
               "pipelined_per_s": median(pipe), "task_rtt_us": median(task_rtt) * 1e6,
               "create_first_call_ms": median(create) * 1e3,
               "ninth_actor_ms": median(ninth) * 1e3, "array_gbs": median(array) / 1e9,
               "stream_items_per_s": median(stream)}
        if os.path.isdir("/proc/self/task"):
            worker = mod.get(actor.pid.remote(), timeout=60)
            out["cpu"] = cpu_per_call(lambda: mod.get(actor.f.remote(1)),
                                      {"caller": os.getpid(), "actor's worker": worker},
                                      2000 if quick else 10_000)
        return out




def main(quick: bool = False) -> dict[str, dict[str, float]]:
    import pmetal
    results: dict[str, dict[str, float]] = {}
    cold_runs = 3 if quick else 7
    init_s, cold_s = _cold_start("pmetal", "", cold_runs)
    results["pmetal"] = {"init_s": init_s, "cold_start_s": cold_s}
    pmetal.init()
    try:
        results["pmetal"].update(Target(pmetal).measure(quick))
    finally:
        pmetal.shutdown()
    try:
        import ray
    except ImportError:
        ray = None
    if ray is not None:
        init_s, cold_s = _cold_start("ray", "num_cpus=2", 1)
        results["ray"] = {"init_s": init_s, "cold_start_s": cold_s}
        ray.init(num_cpus=2)
        try:
            results["ray"].update(Target(ray).measure(quick))
        finally:
            ray.shutdown()
        ray_name = "ray (this run)"
    else:
        results["ray"] = RAY_ANCHOR
        ray_name = "ray (anchor figures, not installed here)"
    ours, theirs = results["pmetal"], results["ray"]
    rows = [
        ["pmetal.init() / ray.init() (s)", ours["init_s"], theirs["init_s"], "< 0.5"],
        ["cold start: init + create + first call, fresh process (s)", ours["cold_start_s"],
         theirs["cold_start_s"], "< 0.3"],
        ["actor call round trip, median (us)", ours["rtt_us"], theirs["rtt_us"], "< 300"],
        ["actor call round trip, p99 (us)", ours["rtt_p99_us"],
         theirs.get("rtt_p99_us", float("nan")), ""],
        ["pipelined actor calls/s", ours["pipelined_per_s"], theirs["pipelined_per_s"],
         ">= 15,000"],
        ["remote function round trip (us)", ours["task_rtt_us"], theirs["task_rtt_us"], "< 500"],
        ["actor create + first call, warm pool (ms)", ours["create_first_call_ms"],
         theirs["create_first_call_ms"], "< 50"],
        ["ninth actor create + first call, pool used up (ms)", ours["ninth_actor_ms"],
         theirs["ninth_actor_ms"], "< 50"],
        ["64 MiB array to an actor (GB/s)", ours["array_gbs"], theirs["array_gbs"], ">= 1.65"],
        ["streamed items/s (num_returns='streaming', get each)", ours["stream_items_per_s"],
         theirs.get("stream_items_per_s", float("nan")), ""],
    ]
    print(table(f"actors: pmetal vs {ray_name}", ["measure", "pmetal", "ray", "target"], rows))
    if "cpu" in ours:
        cpu = ours["cpu"]
        print(table("actor call round trip: CPU per call by thread (us, /proc)",
                    ["process: thread", "pmetal"],
                    [*([k, v] for k, v in cpu.items()), ["total", sum(cpu.values())]]))
    return results
