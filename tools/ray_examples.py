"""Run Ray scripts on pmetal, unchanged, and say what stops each one.

    python tools/ray_examples.py FOLDER                      # every *.py in FOLDER on pmetal
    python tools/ray_examples.py FOLDER --ray-python /path/to/venv/bin/python
    python tools/ray_examples.py FOLDER --only tasks.py actor-pool.py
    python tools/ray_examples.py FOLDER --json out.json      # the rows, for a later --ray-json
    python tools/ray_examples.py FOLDER --ray-json out.json  # Ray's column from an earlier run

The folder holds Ray's own scripts (for us: Ray Core's documentation examples,
``doc/source/ray-core/doc_code`` in Ray's repository, fetched by hand: their code is
Ray's and never enters this repository). Each script runs in a fresh Python
process with a deadline, in its own working folder and its own ``PMETAL_HOME``,
and ``import ray`` gives pmetal: the harness puts first on ``PYTHONPATH`` a
folder with a ``ray`` package that only renames. Its import hook maps every
``ray.X`` module to ``pmetal.X`` (``ray.util.queue`` is ``pmetal.util.queue``,
``ray.exceptions`` is ``pmetal.exceptions``, ...) and ``ray`` itself is the
``pmetal`` module: nothing is added, so a script uses exactly pmetal's API and
a name pmetal lacks fails the way it would in the user's hands.

With ``--ray-python`` each script also runs under real Ray (the interpreter of
a virtualenv where Ray is installed; no alias), so that "pmetal fails" is told
apart from "the example cannot run on this machine at all" (it fails on Ray
too: an example that needs a missing library, or that is broken upstream).

The table gives, per script, pass/fail on pmetal (and Ray), the first error
line (the exception that ended the script) and what blocked it, a category
found from that error (:data:`BLOCKERS`). Scripts this machine cannot run
(GPUs, torch, a Ray cluster CLI, Java, ...) are listed in :data:`EXCLUDED`
with the reason and are not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

DEFAULT_DEADLINE = 120.0

# Scripts of Ray's doc_code that run long by design (sleeps, large sorts):
# they get more time so that a slow machine does not pass for a hang.
DEADLINES = {
    "streaming_generator.py": 240.0,
    "pattern_tree_of_tasks.py": 300.0,
    "pattern_nested_tasks.py": 300.0,
    "getting_started.py": 240.0,
    "monte_carlo_pi.py": 240.0,
}

# Ray Core's documentation examples that this machine (2 cores, no GPU, no
# internet, no torch or TensorFlow) cannot run at all, with why. The harness
# skips them when they are in the folder.
EXCLUDED = {
    "cgraph_nccl.py": "needs GPUs, torch and NCCL",
    "cgraph_overlap.py": "needs GPUs, torch and NCCL",
    "cgraph_profiling.py": "needs GPUs, torch and Nsight; pip-installs from Ray's source tree",
    "cgraph_quickstart.py": "ends with a 2-GPU torch/NCCL section (and the indexed copy "
                            "does not parse)",
    "cross_language.py": "needs Java code on a code_search_path",
    "direct_transport_ds.py": "needs torch and Ascend NPUs",
    "direct_transport_dtensor.py": "needs torch",
    "direct_transport_gloo.py": "needs torch",
    "direct_transport_nccl.py": "needs torch and GPUs",
    "direct_transport_nixl.py": "needs torch, GPUs and NIXL",
    "gpu_objects_gloo.py": "needs torch",
    "gpu_objects_nccl.py": "needs torch and GPUs",
    "gpu_objects_nixl.py": "needs torch, GPUs and NIXL",
    "gpus.py": "GPU ids and CUDA_VISIBLE_DEVICES, TensorFlow, ray._private constants",
    "neuron_core_accelerator.py": "needs AWS Neuron cores; ray._private",
    "tf_example.py": "needs TensorFlow",
    "torch_example.py": "needs torch",
    "limit_tasks.py": "a million calls with 8 MB arrays: hours on this machine",
    "limiting_memory_usage.py": "exhausts the machine's memory on purpose; ray._private",
    "ray_oom_prevention.py": "exhausts the machine's memory on purpose; Ray's memory "
                             "monitor (_system_config)",
    "metrics_example.py": "exports Prometheus metrics on port 8080 of every interface "
                          "and sleeps 30 s",
    "namespaces.py": "needs the `ray start` CLI and Ray Client (ray://) connections",
    "runtime_env_example.py": "conda and pip environments: needs the internet",
    "object_ref_serialization.py": "Ray internals (ray._private.internal_api.free)",
    "anti_pattern_out_of_band_object_ref_serialization.py":
        "Ray internals (ray._private.internal_api.memory_summary)",
}

# What blocked a script, from its error: the first category whose pattern is
# found in the error line wins, so the specific ones come first.
BLOCKERS: list[tuple[str, str]] = [
    ("deadline", r"^deadline exceeded"),
    ("nested refs", (r"ObjectRef cannot be sent inside|cannot send \w+ object .*ObjectRef"
                     r"|OwnerDiedError|ObjectRef\(bytes|'ObjectRef' object has no attribute")),
    ("streaming generators", (r"streaming|\bdynamic\b|ObjectRefGenerator|GeneratorType"
                              r"|generator object|cannot send generator"
                              r"|'ObjectRef' object is not (an iterator|iterable)")),
    ("placement groups", r"placement_group|PlacementGroup(?!Scheduling)"),
    ("scheduling_strategy", r"scheduling_strategy|SchedulingStrategy"),
    ("runtime_env", r"runtime_env|worker_process_setup_hook"),
    ("cancel", r"TaskCancelledError|is_canceled|cancel"),
    ("WorkerCrashedError (a task's dead worker)", r"ActorDiedError: remote function"),
    ("compiled graphs (not planned)", r"experimental_compile|visualize"),
    ("ray.dag", r"\bbind\b|ray\.dag|'dag'"),
    ("ray.experimental", r"experimental"),
    ("resources", r"num_gpus|num_cpus|\bGPU\b|\bCPU\b|\bresources\b|memory="),
    ("missing API name", (r"has no attribute|cannot import name|No module named 'ray"
                          r"|unexpected keyword argument|unknown option|not a valid option"
                          r"|got an unexpected|takes no")),
    ("needs a library not installed", r"No module named"),
]

ALIAS = textwrap.dedent('''\
    """ray -> pmetal, by renaming only (written by pmetal's tools/ray_examples.py)."""
    import importlib
    import importlib.abc
    import importlib.util
    import sys

    import pmetal


    class _Loader(importlib.abc.Loader):
        def __init__(self, module):
            self._module = module

        def create_module(self, spec):
            return self._module

        def exec_module(self, module):
            pass


    class _RayIsPmetal(importlib.abc.MetaPathFinder):
        """``ray.X`` is ``pmetal.X`` when pmetal has it; else it does not exist."""

        def find_spec(self, fullname, path=None, target=None):
            if not fullname.startswith("ray."):
                return None
            target_name = "pmetal." + fullname[len("ray."):]
            try:
                module = importlib.import_module(target_name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and target_name.startswith(exc.name):
                    raise ModuleNotFoundError(f"No module named {fullname!r}",
                                              name=fullname) from None
                raise
            return importlib.util.spec_from_loader(fullname, _Loader(module))


    sys.meta_path.insert(0, _RayIsPmetal())
    sys.modules["ray"] = pmetal
''')


@dataclasses.dataclass
class Run:
    """One script run under one runtime."""

    ok: bool
    seconds: float
    error: str      # the exception line that ended the script ("" when it passed)
    blocker: str    # a BLOCKERS category ("" when it passed)


@dataclasses.dataclass
class Row:
    example: str
    pmetal: Run | None = None
    ray: Run | None = None


def first_error_line(stderr: str) -> str:
    """The exception line of the first traceback in ``stderr`` (what ended the
    script), else its last non-empty line. Terminal colours are dropped."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", stderr).splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            for later in lines[i + 1:]:
                if later and not later.startswith((" ", "\t")):
                    return later.strip()
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def blocker_of(error: str) -> str:
    for category, pattern in BLOCKERS:
        if re.search(pattern, error):
            return category
    return "other"


def run_script(script: Path, python: str, env: dict[str, str], deadline: float) -> Run:
    """Run ``script`` with ``python`` in a fresh folder; kill its whole process
    group when ``deadline`` passes."""
    workdir = Path(tempfile.mkdtemp(prefix="rayex-"))
    started = time.monotonic()
    proc = subprocess.Popen([python, str(script.resolve())], cwd=workdir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=deadline)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:   # anything the script left behind (workers, daemons) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        _, stderr = proc.communicate()
    seconds = time.monotonic() - started
    shutil.rmtree(workdir, ignore_errors=True)
    if timed_out:
        error = f"deadline exceeded ({deadline:.0f} s); last line: {first_error_line(stderr)}"
        return Run(False, seconds, error[:300], "deadline")
    if proc.returncode == 0:
        return Run(True, seconds, "", "")
    error = first_error_line(stderr) or f"exit status {proc.returncode}"
    return Run(False, seconds, error, blocker_of(error))


def pmetal_env(alias_dir: Path, home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(alias_dir), env.get("PYTHONPATH"))
                                        if p)
    env["PMETAL_HOME"] = str(home)
    return env


def ray_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMETAL_", "PYTHONPATH"))}
    # Ray's node then listens on 127.0.0.1, not on the machine's interface
    # (services.get_node_ip_address), and reports nothing home.
    env.update(RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    return env


def run_all(scripts: list[Path], *, ray_python: str | None, ray_rows: dict[str, Run],
            python: str = sys.executable, progress=None) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ray-alias-") as alias:
        alias_dir = Path(alias)
        (alias_dir / "ray").mkdir()
        (alias_dir / "ray" / "__init__.py").write_text(ALIAS)
        for script in scripts:
            deadline = DEADLINES.get(script.name, DEFAULT_DEADLINE)
            row = Row(script.name)
            with tempfile.TemporaryDirectory(prefix="pmetal-home-") as home:
                row.pmetal = run_script(script, python, pmetal_env(alias_dir, Path(home)),
                                        deadline)
            if script.name in ray_rows:
                row.ray = ray_rows[script.name]
            elif ray_python:
                with tempfile.TemporaryDirectory(prefix="r", dir="/tmp") as tmp:
                    row.ray = run_script(script, ray_python, ray_env(Path(tmp)), deadline)
            rows.append(row)
            if progress:
                progress(row)
    return rows


def _cell(run: Run | None) -> str:
    if run is None:
        return ""
    return f"{'pass' if run.ok else 'FAIL'} {run.seconds:.0f}s"


def table(rows: list[Row]) -> str:
    with_ray = any(r.ray for r in rows)
    head = ["example", "pmetal"] + (["Ray"] if with_ray else []) + ["blocker", "first error line"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        run = r.pmetal
        blocker = run.blocker if run and not run.ok else ""
        if with_ray and r.ray and not r.ray.ok:
            blocker = ("example cannot run here (fails on Ray too)" if run and not run.ok
                       else "fails on Ray here; passes on pmetal")
        error = run.error if run and not run.ok else ""
        if r.ray and not r.ray.ok:
            error = f"{error} (Ray: {r.ray.error})" if error else f"(Ray: {r.ray.error})"
        error = error.replace("|", "\\|")[:240]
        cells = [r.example, _cell(run)] + ([_cell(r.ray)] if with_ray else [])
        out.append("| " + " | ".join(cells + [blocker, error]) + " |")
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    lines = []
    total = len(rows)
    passed = sum(1 for r in rows if r.pmetal and r.pmetal.ok)
    lines.append(f"pmetal: {passed} of {total} examples pass")
    sound = [r for r in rows if r.ray is None or r.ray.ok]
    if any(r.ray for r in rows):
        unsound = [r.example for r in rows if r.ray and not r.ray.ok]
        ray_pass = total - len(unsound)
        lines.append(f"Ray: {ray_pass} of {total} pass on this machine; failing on Ray "
                     f"too (cannot run here): {', '.join(unsound) or 'none'}")
        sound_pass = sum(1 for r in sound if r.pmetal and r.pmetal.ok)
        lines.append(f"pmetal passes {sound_pass} of the {len(sound)} that Ray runs here")
    counts: dict[str, list[str]] = {}
    for r in sound:
        if r.pmetal and not r.pmetal.ok:
            counts.setdefault(r.pmetal.blocker, []).append(r.example)
    for blocker, names in sorted(counts.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"  {len(names):2d} blocked by {blocker}: {', '.join(names)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/ray_examples.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a folder of Ray scripts (*.py)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these scripts")
    parser.add_argument("--ray-python", metavar="PYTHON",
                        help="also run each script under real Ray with this interpreter")
    parser.add_argument("--ray-json", type=Path, metavar="FILE",
                        help="take Ray's results from an earlier --json output")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--quiet", action="store_true", help="no line per script while running")
    args = parser.parse_args(argv)
    # A TERM ends the run through the same cleanup as the deadline: the script
    # running now and all it started are killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder of Ray scripts")
    scripts = sorted(p for p in args.folder.glob("*.py") if p.name not in EXCLUDED)
    if args.only:
        unknown = set(args.only) - {p.name for p in scripts}
        if unknown:
            parser.error(f"not in {args.folder} (or excluded): {sorted(unknown)}")
        scripts = [p for p in scripts if p.name in args.only]
    ray_rows: dict[str, Run] = {}
    if args.ray_json:
        for item in json.loads(args.ray_json.read_text()):
            if item.get("ray"):
                ray_rows[item["example"]] = Run(**item["ray"])

    def progress(row: Row) -> None:
        if not args.quiet:
            print(f"{row.example:55s} pmetal {_cell(row.pmetal):10s} Ray {_cell(row.ray)}",
                  file=sys.stderr, flush=True)

    rows = run_all(scripts, ray_python=args.ray_python, ray_rows=ray_rows, progress=progress)
    print(table(rows))
    print()
    print(summary(rows))
    print(f"\nnot run: {len(EXCLUDED)} of Ray Core's doc_code examples this machine "
          f"cannot run (skipped when present in the folder):")
    for name, why in sorted(EXCLUDED.items()):
        print(f"  {name}: {why}")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
