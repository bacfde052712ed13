"""How fast the model store moves a model between nodes (opt-in: it needs the
default model, ``pmetal models fetch``).

    python -m benchmarks store

A node daemon on 127.0.0.1 holds the model in a home of its own (a hard
link to the file of this machine's store, with its manifest); a process
with another empty home pulls from it over the namespace's channels (CURVE
and pmetal's sealed sessions, bulk authentication on, the default):

1. *whole*: ``pmetal models pull SHA --from ADDRESS``, every piece checked on
   arrival and the whole file at the end: the time it reports (asking for
   the manifest to the whole-file check) and the command's wall time
   (starting Python and its imports included);
2. *a stage's share*: what the second of two stages reads (the header, the
   last half of the layers, the norm and the tied head: ``Puller.pull`` of
   ``loader.stage_tensors``), timed inside the process.

Each row is the median of 3 runs into a fresh home; max RSS is the pulling
process's peak (the transfer holds at most 8 x 1 MiB chunks, whatever the
model's size).
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, table

RUNS = 3

SHARE = r"""
import json, resource, sys
from pmetal.config import load_config, pmetal_home
from pmetal.pipeline.loader import load_config as model_config, stage_tensors
from pmetal.security import NetworkNamespace
from pmetal.store import PieceStore
from pmetal.store.pull import Puller
sha, address = sys.argv[1], sys.argv[2]
store = PieceStore(pmetal_home() / "models")
config = load_config()
with Puller(store, [address], namespace=NetworkNamespace.resolve(config.security),
            config=config) as puller:
    header = puller.pull(sha, [])
    config = model_config(header.folder.path)
    half = config.num_hidden_layers // 2
    names = stage_tensors(header.folder.manifest.by_name, config, half, config.num_hidden_layers)
    result = puller.pull(sha, names)
print(json.dumps({"bytes": header.pulled + result.pulled,
                  "seconds": header.seconds + result.seconds,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _model() -> Path:
    from pmetal.pipeline.models import DEFAULT_MODEL, ModelStore

    store = ModelStore()
    entry = store.entry(DEFAULT_MODEL)
    for path in (store.path_of(DEFAULT_MODEL), store.root / entry.name / entry.filename):
        if path.is_file():
            return path
    raise SystemExit(f"the store benchmark moves the default model: fetch it first "
                     f"('pmetal models fetch'; looked in {store.root})")


def main(quick: bool = False) -> None:
    from pmetal.node.daemon import read_ready_line
    from pmetal.pipeline.models import ModelStore

    model = _model()
    psk = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory(prefix="pmetal-bench-store-") as tmp:
        holder = Path(tmp) / "holder"
        holder.mkdir(mode=0o700)
        sha = ModelStore(holder / "models").add(model).manifest.sha256
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(PMETAL_PSK_HEX=psk.hex())
        node = subprocess.Popen(
            [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1", "--port", "0",
             "--no-discovery", "--num-workers", "1", "--num-task-workers", "1"],
            env={**env, "PMETAL_HOME": str(holder)}, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            address = read_ready_line(node, 30.0).split()[1]
            rows = []
            whole, wall, share = [], [], []
            for run in range(1 if quick else RUNS):
                home = Path(tmp) / f"whole{run}"
                home.mkdir(mode=0o700)
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "pmetal", "models", "pull", sha,
                                       "--from", address], env={**env, "PMETAL_HOME": str(home)},
                                      check=True, capture_output=True, text=True, timeout=300)
                wall.append(time.perf_counter() - started)
                # "pmetal: 98.4 MB in 1.2 s, every piece and the whole file checked"
                whole.append(float(re.search(r"MB in ([0-9.]+) s", done.stderr)[1]))
                home = Path(tmp) / f"share{run}"
                home.mkdir(mode=0o700)
                done = subprocess.run([sys.executable, "-c", SHARE, sha, address],
                                      env={**env, "PMETAL_HOME": str(home)}, check=True,
                                      capture_output=True, text=True, timeout=300)
                share.append(json.loads(done.stdout))
            size = model.stat().st_size
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            rows.append(["whole model, `pmetal models pull` (as it reports)", size / 1e6,
                         median(whole), size / 1e6 / median(whole), "-"])
            rows.append(["the same, wall time of the command (Python's start included)",
                         size / 1e6, median(wall), size / 1e6 / median(wall), "-"])
            seconds = median([s["seconds"] for s in share])
            rows.append(["a stage's share (second of 2 stages), in process",
                         share[0]["bytes"] / 1e6, seconds, share[0]["bytes"] / 1e6 / seconds,
                         max(s["rss"] for s in share) / 1024])
        finally:
            node.terminate()
            node.wait(timeout=10)
    print(table(f"Model store: pulling over 127.0.0.1 ({model.name}; largest child RSS "
                f"{rss:.0f} MiB)", ["pull", "MB", "s", "MB/s", "max RSS MiB"], rows))


if __name__ == "__main__":
    main()
