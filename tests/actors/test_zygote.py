"""The fork server (pmetal.node.zygote): a node's workers are forks of a
warm process, and the node copes when that process dies.

Real node, fork server and worker processes; the module's cluster (an
embedded node with two pre-started actor workers) is shared, and the last
test, which kills the fork server, makes a node of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal import api
from pmetal.node.zygote import UNKNOWN_EXIT
from pmetal.errors import ActorDiedError

from .actor_classes import Counter
from .conftest import (
    WAIT,
    actor_state,
    assert_all_exit,
    parent_pid,
    pid_alive,
    shutdown_quietly,
    wait_until,
)

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


def node_pid() -> int:
    assert api._node_proc is not None
    return api._node_proc.pid


def pool() -> dict[str, Any]:
    return api.client().status()["pool"]


def fork_server_of(pid: int) -> int:
    """The fork server that forked worker ``pid`` (checked to be the node's)."""
    zygote = parent_pid(pid)
    assert zygote != node_pid(), "the worker was started by the node itself"
    assert parent_pid(zygote) == node_pid()
    return zygote


@pmetal.remote
class Crasher:
    def pid(self) -> int:
        return os.getpid()

    def exit(self, code: int) -> None:
        os._exit(code)


@pmetal.remote
class Draws:
    def __init__(self) -> None:
        # What the worker got from the fork server, before any code of its own.
        self.inherited = sorted(m for m in ("numpy.random", "mlx", "mlx.core")
                                if m in sys.modules)

    def inherited_modules(self) -> list[str]:
        return self.inherited

    def draw(self) -> tuple[float, float]:
        import random

        import numpy as np
        return random.random(), float(np.random.random())


def test_workers_are_forks_of_the_fork_server() -> None:
    actor = Counter.remote()
    try:
        pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
        fork_server_of(pid)
        stats = pool()
        assert stats["forked"] >= NUM_WORKERS + 1
        assert stats["forked"] == stats["started"], "some workers were started as interpreters"
    finally:
        pmetal.kill(actor)


def test_a_crashing_worker_reports_its_code_and_leaves_the_fork_server_serving() -> None:
    crasher = Crasher.remote()
    zygote = fork_server_of(pmetal.get(crasher.pid.remote(), timeout=WAIT))
    with pytest.raises(ActorDiedError):
        pmetal.get(crasher.exit.remote(7), timeout=WAIT)
    # The code travels from the fork server (which reaped the worker) to the node.
    state = wait_until(lambda: actor_state(crasher)["state"] == "dead" and actor_state(crasher),
                       WAIT, what="the crashed actor marked dead")
    assert "exited with code 7" in state["reason"]
    assert pid_alive(zygote)
    after = Counter.remote()
    try:
        assert fork_server_of(pmetal.get(after.pid.remote(), timeout=WAIT)) == zygote
    finally:
        pmetal.kill(after)


def test_forked_workers_draw_different_random_numbers() -> None:
    # numpy's global generator is seeded once, in the fork server (which
    # loads numpy.random once the pool's first workers run): each worker
    # must reseed it, or every actor draws the same numbers.
    def forked_with_numpy() -> Any:
        actor = Draws.remote()
        inherited = pmetal.get(actor.inherited_modules.remote(), timeout=WAIT)
        # MLX (Metal on macOS) must never be loaded before a fork.
        assert "mlx" not in inherited and "mlx.core" not in inherited
        if "numpy.random" in inherited:
            return actor
        pmetal.kill(actor)
        return None

    actors = [wait_until(forked_with_numpy, WAIT, what="a worker forked with numpy loaded")
              for _ in range(3)]
    try:
        draws = pmetal.get([a.draw.remote() for a in actors], timeout=WAIT)
        assert len({d[0] for d in draws}) == 3
        assert len({d[1] for d in draws}) == 3
    finally:
        for a in actors:
            pmetal.kill(a)


def test_creations_beyond_the_pool_fork_workers_on_demand() -> None:
    # Six at once on a pool of two: the four without an idle worker each
    # get one forked for them (not one after another as replacements come).
    actors = [Counter.remote() for _ in range(6)]
    try:
        pids = pmetal.get([a.pid.remote() for a in actors], timeout=WAIT)
        assert len(set(pids)) == 6
        assert {fork_server_of(p) for p in pids} == {fork_server_of(pids[0])}
    finally:
        for a in actors:
            pmetal.kill(a)
    # The pool is back to its size: no worker left over per creation.
    wait_until(lambda: pool()["idle"] == NUM_WORKERS and pool()["starting"] == 0, WAIT,
               what="the pool back to its size")


def test_an_idle_worker_that_dies_is_replaced() -> None:
    wait_until(lambda: pool()["idle"] == NUM_WORKERS, WAIT, what="a full pool")
    idle = [w for w in api.client().status()["workers"]
            if w["role"] == "actor" and not w["actor_id"] and w["ready"]]
    os.kill(idle[0]["pid"], signal.SIGKILL)

    def replaced() -> bool:
        workers = api.client().status()["workers"]
        return (idle[0]["pid"] not in {w["pid"] for w in workers}
                and pool()["idle"] == NUM_WORKERS)

    wait_until(replaced, WAIT, what="the dead idle worker replaced")


DRIVER = textwrap.dedent("""
    import json, os, sys
    import pmetal

    @pmetal.remote
    class Greeter:
        def greet(self):
            import helper                     # beside this script: the driver's sys.path
            print("printed by", helper.NAME, flush=True)
            return os.getpid()

    pmetal.init()
    pid = pmetal.get(Greeter.remote().greet.remote(), timeout=30)
    info = {"worker": pid, "node": pmetal.api._node_proc.pid,
            "pool": pmetal.api.client().status()["pool"]}
    print("RESULT " + json.dumps(info), flush=True)
    pmetal.shutdown()
""")


def test_a_fresh_driver_gets_forked_workers_with_its_path_and_output(tmp_path: Path) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "helper.py").write_text("NAME = 'the helper module'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(pmetal.__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "driver.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "printed by the helper module" in done.stdout
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    info = json.loads(result[0][len("RESULT "):])
    assert info["pool"]["forked"] >= 1
    assert info["pool"]["forked"] == info["pool"]["started"]


def test_a_dead_fork_server_makes_the_node_start_interpreters() -> None:
    # Last in the module: it kills the module's fork server.
    survivor = Crasher.remote()
    victim = Crasher.remote()
    survivor_pid = pmetal.get(survivor.pid.remote(), timeout=WAIT)
    victim_pid = pmetal.get(victim.pid.remote(), timeout=WAIT)
    zygote = fork_server_of(survivor_pid)
    forked = pool()["forked"]
    os.kill(zygote, signal.SIGKILL)
    assert_all_exit([zygote], what="the killed fork server")
    # New workers are interpreters now, children of the node itself (the
    # idle ones forked before are used up first).
    fresh = [Counter.remote() for _ in range(NUM_WORKERS + 1)]
    try:
        pids = pmetal.get([a.pid.remote() for a in fresh], timeout=WAIT + 20)
        assert any(parent_pid(p) == node_pid() for p in pids)
        stats = pool()
        assert stats["forked"] == forked and stats["started"] > forked
        # Workers the dead fork server forked keep serving...
        assert pmetal.get(survivor.pid.remote(), timeout=WAIT) == survivor_pid
        # ...and their death is still noticed (the code is unknown by then).
        os.kill(victim_pid, signal.SIGKILL)
        state = wait_until(lambda: actor_state(victim)["state"] == "dead" and actor_state(victim),
                           WAIT, what="the orphaned worker's actor marked dead")
        assert "exit code is unknown" in state["reason"]
        with pytest.raises(ActorDiedError):
            pmetal.get(victim.pid.remote(), timeout=WAIT)
        # pmetal.kill still reaches an orphan (the node signals it itself).
        pmetal.kill(survivor)
        assert_all_exit([survivor_pid], what="the orphaned worker killed by pmetal.kill")
    finally:
        for a in [*fresh, survivor]:
            pmetal.kill(a)
        shutdown_quietly()
