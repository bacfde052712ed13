"""``pmetal bench memory``: what ``pmetal generate`` holds, every process counted.

Runs ``pmetal generate --stages K`` (the default model unless ``--model``)
in a session of its own and samples every process of that session (the
driver, the embedded node, its fork server, the stage workers) every
``interval`` seconds from ``/proc/<pid>/smaps_rollup`` (Linux only):

* **held**: anonymous plus shared memory, proportional (``Pss_Anon +
  Pss_Shmem``): what the processes cost the machine. Pages of a
  memory-mapped model file are not counted: they are the page cache's, shared
  with every process that maps the file and dropped under pressure.
* **model pages**: per stage worker, the resident pages of the model file's
  mapping (``Rss`` of that mapping in ``/proc/<pid>/smaps``): whether a
  stage reads only its own layers. Compared with the stage's share of the
  file's tensor bytes.

The peak of the sum over all processes is the figure the [7/11] target
bounds (<= 400 MB for one stage of the default model).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pmetal.errors import ConfigError

__all__ = ["MemoryRow", "measure", "run"]

MB = 1 << 20


@dataclass
class MemoryRow:
    """One run of ``pmetal generate``: peaks in bytes."""

    stages: int
    backend: str
    peak_total: int = 0                       # max over samples of the sum over processes
    peak_by_role: dict[str, int] = field(default_factory=dict)
    model_pages: dict[str, int] = field(default_factory=dict)  # stage worker -> file Rss peak
    shares: dict[str, int] = field(default_factory=dict)   # stage worker -> its tensor bytes
    tokens_per_second: float | None = None
    returncode: int | None = None
    output: str = ""


def _session(sid: int) -> dict[int, int]:
    """Every process of session ``sid``: pid -> parent pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:
            found[int(entry)] = int(fields[1])
    return found


def _held(pid: int) -> int:
    total = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def _file_rss(pid: int, path: str) -> int:
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    inside = line.rstrip().endswith(path)
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


# Depth below the driver -> role: the driver starts the embedded node, the
# node its fork server, which forks the workers; a worker may start helpers.
_ROLES = ("driver", "node", "fork server", "worker", "helper")


def _role(pid: int, parents: dict[int, int], leader: int) -> str:
    depth = 0
    while pid != leader and pid in parents and depth < len(_ROLES) - 1:
        pid, depth = parents[pid], depth + 1
    return _ROLES[depth]


def measure(stages: int, *, model: str | None = None, backend: str = "auto",
            max_tokens: int = 32, interval: float = 0.02, timeout: float = 600.0) -> MemoryRow:
    """Run ``pmetal generate`` once and return its memory peaks."""
    if not Path("/proc/self/smaps_rollup").exists():
        raise ConfigError("pmetal bench memory reads /proc/<pid>/smaps_rollup: Linux only")
    from pmetal.pipeline.models import resolve_model

    path = str(resolve_model(model, progress=sys.stderr))
    cmd = [sys.executable, "-m", "pmetal", "generate", "--stages", str(stages),
           "--max-tokens", str(max_tokens), "--backend", backend, "--model", path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    row = MemoryRow(stages, backend)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total = 0
            parents = _session(proc.pid)
            for pid in parents:
                held = _held(pid)
                total += held
                role = f"{_role(pid, parents, proc.pid)} {pid}"
                row.peak_by_role[role] = max(row.peak_by_role.get(role, 0), held)
                if "worker" in role:
                    row.model_pages[role] = max(row.model_pages.get(role, 0),
                                                _file_rss(pid, path))
            row.peak_total = max(row.peak_total, total)
            done.wait(interval)

    sampler = threading.Thread(target=sample, name="pmetal-bench-memory", daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
    finally:
        done.set()
        sampler.join(timeout=10)
    row.returncode = proc.returncode
    row.output = out.decode(errors="replace")
    for line in row.output.splitlines():
        if "tokens/s" in line and "then" in line:
            row.tokens_per_second = float(line.rsplit("then ", 1)[1].split()[0])
        found = _STAGE_LINE.search(line)
        if found:
            first, last, pid = (int(g) for g in found.groups())
            row.shares[f"worker {pid}"] = _share(path, first, last + 1)
    return row


# "stage 0 layers 0-14 on node 1a2b3c4d (pid 1234): ..." in pmetal generate's report
_STAGE_LINE = re.compile(r"stage \d+ layers (\d+)-(\d+) on node \S+ \(pid (\d+)\)")


def _share(path: str, start: int, end: int) -> int:
    """Bytes of the GGUF file's tensors that a stage of layers
    ``[start, end)`` holds: its layers, the embedding on the first stage, the
    final norm and the head (the embedding again when tied) on the last."""
    from pmetal.pipeline.gguf_file import GGUFFile

    with GGUFFile(path) as file:
        count = int(file.metadata.get(f"{file.metadata.get('general.architecture')}"
                                      ".block_count", 0))
        names = [n for n in file.tensors
                 if n.startswith("blk.") and start <= int(n.split(".")[1]) < end]
        if start == 0:
            names.append("token_embd.weight")
        if end == count:
            names += ["output_norm.weight",
                      "output.weight" if "output.weight" in file.tensors else "token_embd.weight"]
        return sum(file.tensors[n].nbytes for n in set(names) if n in file.tensors)


def run(stage_counts: list[int], *, model: str | None = None, backend: str = "auto",
        out: TextIO | None = None, markdown: bool = False) -> list[MemoryRow]:
    """Measure each stage count and print a table."""
    out = out or sys.stdout
    rows = [measure(k, model=model, backend=backend) for k in stage_counts]
    bar = "|" if markdown else " "
    print(f"{bar} stages {bar} backend {bar} peak held, all processes (MB) {bar} "
          f"each stage: held (MB) {bar} each stage: model pages / its tensor bytes (MB) {bar} "
          f"tok/s {bar}", file=out)
    if markdown:
        print("|---|---|---|---|---|---|", file=out)
    for r in rows:
        held = ", ".join(f"{r.peak_by_role.get(w, 0) / MB:.0f}" for w in r.shares) or "-"
        pages = ", ".join(f"{r.model_pages.get(w, 0) / MB:.1f} / {share / MB:.1f}"
                          for w, share in r.shares.items()) or "-"
        rate = "-" if r.tokens_per_second is None else f"{r.tokens_per_second:.1f}"
        status = "" if r.returncode == 0 else f" (exit {r.returncode})"
        print(f"{bar} {r.stages} {bar} {r.backend} {bar} {r.peak_total / MB:.0f}{status} {bar} "
              f"{held} {bar} {pages} {bar} {rate} {bar}", file=out)
    return rows
