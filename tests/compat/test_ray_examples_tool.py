"""tools/ray_examples.py, the harness that runs Ray scripts on pmetal: its
``ray`` alias renames only, every run gets its own PMETAL_HOME and a deadline
that takes the script's whole process group down, and the table says what
blocked each failure. The scripts here are our own small Ray scripts."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ray_examples", ROOT / "tools" / "ray_examples.py")
assert spec is not None and spec.loader is not None
ray_examples = importlib.util.module_from_spec(spec)
sys.modules["ray_examples"] = ray_examples   # dataclasses look their module up
spec.loader.exec_module(ray_examples)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    homes = tmp_path / "homes"
    homes.mkdir()
    write(folder, "a_ok.py", f"""
        import os
        import ray
        import ray.exceptions
        import ray.util.queue
        import pmetal
        assert ray is pmetal and ray.util.queue is pmetal.util.queue
        assert ray.exceptions.GetTimeoutError is pmetal.GetTimeoutError

        @ray.remote
        def f(x):
            return x + 1

        assert ray.get(f.remote(1)) == 2
        open(os.path.join({str(homes)!r}, "a"), "w").write(os.environ["PMETAL_HOME"])
    """)
    write(folder, "b_missing.py", f"""
        import os
        open(os.path.join({str(homes)!r}, "b"), "w").write(os.environ["PMETAL_HOME"])
        import ray.no_such_module
    """)
    write(folder, "c_raises.py", """
        import ray
        raise RuntimeError("the script's own error")
    """)
    write(folder, "gpus.py", "raise SystemExit('an excluded example must not run')\n")
    return folder


def test_rows_say_pass_fail_and_the_blocker(scripts: Path, tmp_path: Path) -> None:
    paths = sorted(p for p in scripts.glob("*.py") if p.name not in ray_examples.EXCLUDED)
    rows = ray_examples.run_all(paths, ray_python=None, ray_rows={})
    by_name = {row.example: row.pmetal for row in rows}
    assert set(by_name) == {"a_ok.py", "b_missing.py", "c_raises.py"}
    assert by_name["a_ok.py"].ok, by_name["a_ok.py"].error
    missing = by_name["b_missing.py"]
    assert not missing.ok and missing.blocker == "missing API name"
    assert missing.error == "ModuleNotFoundError: No module named 'ray.no_such_module'"
    raised = by_name["c_raises.py"]
    assert raised.error == "RuntimeError: the script's own error" and raised.blocker == "other"
    homes = {(tmp_path / "homes" / n).read_text() for n in ("a", "b")}
    assert len(homes) == 2, "each run gets its own PMETAL_HOME"
    table = ray_examples.table(rows)
    assert "| b_missing.py | FAIL" in table and "missing API name" in table
    assert ray_examples.summary(rows).startswith("pmetal: 1 of 3 examples pass")


def test_the_deadline_kills_the_script_and_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = write(tmp_path, "hangs.py", f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)
    run = ray_examples.run_script(script, sys.executable, dict(os.environ), deadline=2.0)
    assert not run.ok and run.blocker == "deadline"
    assert run.error.startswith("deadline exceeded (2 s)")
    pid = int(pidfile.read_text())
    wait_until(lambda: not alive(pid), 5.0, f"the script's child {pid} gone with its group")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    if not Path("/proc").is_dir():   # macOS: no zombie check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("error, blocker", [
    ("TypeError: an ObjectRef cannot be sent inside another value; pass it", "nested refs"),
    ("PMetalValueError: num_returns='streaming' (generator tasks) is not supported yet",
     "streaming generators"),
    ("TypeError: 'ObjectRef' object is not an iterator", "streaming generators"),
    ("ModuleNotFoundError: No module named 'ray.util.placement_group'", "placement groups"),
    ("PMetalTypeError: unknown option(s) ['scheduling_strategy'] for a remote function",
     "scheduling_strategy"),
    ("AttributeError: 'RemoteFunction' object has no attribute 'bind'", "ray.dag"),
    ("AttributeError: 'MultiOutputNode' object has no attribute 'experimental_compile'",
     "compiled graphs (not planned)"),
    ("AttributeError: module 'pmetal' has no attribute 'actor'", "missing API name"),
    ("AttributeError: module 'pmetal' has no attribute 'dynamic_resources'",
     "missing API name"),
    ("ModuleNotFoundError: No module named 'torch'", "needs a library not installed"),
    ("pmetal.errors.ActorDiedError: remote function f: the connection dropped",
     "WorkerCrashedError (a task's dead worker)"),
    ("AssertionError", "other"),
])
def test_blocker_categories(error: str, blocker: str) -> None:
    assert ray_examples.blocker_of(error) == blocker


def test_first_error_line_is_the_exception_that_ended_the_script() -> None:
    stderr = textwrap.dedent("""\
        INFO some log line
        Traceback (most recent call last):
          File "x.py", line 1, in <module>
            f()
        ValueError: first
        Traceback (most recent call last):
        KeyError: second
    """)
    assert ray_examples.first_error_line(stderr) == "ValueError: first"
    assert ray_examples.first_error_line("just a line\n\n") == "just a line"
