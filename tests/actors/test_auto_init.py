"""Auto-init (Ray's behaviour): a script that never calls ``pmetal.init()``
gets an embedded node from its first ``.remote()``, ``put``, ``get`` or
``wait``, and says so in one INFO line. Code inside workers keeps reaching
its own node instead of starting one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import EXIT_WAIT, pid_alive, wait_until

SCRIPT = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(name)s %(levelname)s %(message)s")
    import pmetal
    from pmetal import api

    @pmetal.remote
    def plus_one(x):
        return x + 1

    @pmetal.remote
    class Inner:
        def node_seen_by_a_nested_task(self):
            @pmetal.remote
            def where():
                return api.client().node_id
            return pmetal.get(where.remote(), timeout=10)

    assert not pmetal.is_initialized()
    first = sys.argv[1]
    if first == "remote":
        assert pmetal.get(plus_one.remote(1), timeout=10) == 2
    elif first == "actor":
        Inner.remote()
    elif first == "put":
        assert pmetal.get(pmetal.put(41)) == 41
    elif first == "get":
        assert pmetal.get([]) == []
    elif first == "wait":
        assert pmetal.wait([], num_returns=0) == ([], [])
    assert pmetal.is_initialized()
    inner = Inner.remote()
    out = {"driver_node": api.client().node_id, "node_pid": api._node_proc.pid,
           "inner_node": pmetal.get(inner.node_seen_by_a_nested_task.remote(), timeout=10)}
    print(json.dumps(out), flush=True)
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auto_init") / "script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("first", ["remote", "actor", "put", "get", "wait"])
def test_the_first_call_without_init_starts_a_local_node(script: Path, first: str) -> None:
    result = subprocess.run([sys.executable, str(script), first], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.stderr.count("Started a local pmetal instance") == 1, result.stderr
    assert "pmetal.api INFO Started a local pmetal instance" in result.stderr
    # A task started inside an actor reached the same node: workers never auto-init.
    assert out["inner_node"] == out["driver_node"]
    # The node was stopped at exit, as one started by init() is.
    wait_until(lambda: not pid_alive(out["node_pid"]), EXIT_WAIT, what="exit of the node")


def test_cluster_queries_without_init_still_say_to_call_init(script: Path) -> None:
    code = ("import pmetal\n"
            "for call in (pmetal.nodes, pmetal.cluster_resources, lambda: pmetal.get_actor('a')):\n"
            "    try:\n"
            "        call()\n"
            "    except pmetal.NotInitializedError as exc:\n"
            "        assert 'pmetal.init()' in str(exc)\n"
            "    else:\n"
            "        raise AssertionError('no NotInitializedError')\n"
            "assert not pmetal.is_initialized()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert (result.returncode, result.stderr) == (0, "")


def test_a_result_pending_at_shutdown_raises_closed_error_instead_of_starting_a_node() -> None:
    code = textwrap.dedent("""
        import time, pmetal

        @pmetal.remote
        def slow():
            time.sleep(60)

        pmetal.init(num_workers=1)
        ref = slow.remote()
        pmetal.shutdown()
        for call in (lambda: pmetal.get(ref, timeout=10), lambda: pmetal.wait([ref])):
            start = time.monotonic()
            try:
                call()
            except pmetal.ClosedError as exc:
                assert "pmetal.shutdown()" in str(exc), exc
                assert time.monotonic() - start < 2, "took too long"
            else:
                raise AssertionError("no ClosedError")
        assert not pmetal.is_initialized()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert (result.returncode, result.stderr) == (0, "")
