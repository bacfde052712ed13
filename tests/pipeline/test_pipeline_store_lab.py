"""Weights travel to the stages that need them, across hosts that share no
filesystem: a network-namespace lab (tests/netlab.py) whose every host runs
in a mount namespace of its own with an empty tmpfs over the other hosts'
PMETAL_HOME, so no process sees another host's files, whatever the path.

The model (a tiny GGUF file) lies in host 1's home only. A driver on host 1
builds pipelines of 3, 2 and 1 stages (one stage per host): each answers
exactly as one process does, and hosts 2 and 3 end up holding only the
pieces of their own share (their stores are read from outside the lab).
Then ``pmetal models pull`` on host 2 takes the whole model from host 1 over
the LAN; a process on host 3 pulling it from host 2 and host 1 sees host 2's
node SIGKILLed after its first piece and finishes from host 1; and a process
on host 3 without the PSK gets nothing from host 1.

It needs root (the lab, the mounts) and skips otherwise.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from cluster.lab import ROOT, LabCluster, read_line
from netlab import HostRef, NetLab, lab_available

from pmetal.pipeline.loader import load_config, stage_tensors
from pmetal.store import HEADER, PieceStore
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2, 3]


class PrivateHomesLab(NetLab):
    """A lab whose host ``i`` sees an empty tmpfs over every other host's
    home (``tmp/h<j>``): each program runs in a mount namespace of its own,
    made by ``unshare --mount`` inside the host's network namespace."""

    def __init__(self, n: int, tmp: Path) -> None:
        super().__init__(n)
        self.tmp = tmp

    def argv(self, host: HostRef, argv: Sequence[str]) -> list[str]:
        index = self.host(host).index
        mounts = [f"mount -t tmpfs -o size=64k pmetal-elsewhere "
                  f"{shlex.quote(str(self.tmp / f'h{j}'))}"
                  for j in range(1, len(self.hosts) + 1) if j != index]
        return super().argv(host, ["unshare", "--mount", "--propagation", "private", "sh",
                                   "-c", " && ".join([*mounts, 'exec "$@"']), "sh", *argv])


DRIVER = r"""
import json, sys
import pmetal
from pmetal.config import load_config
from pmetal.model.quantized import QuantizedStage
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.loader import load_quantized
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig

address, psk, ids, model = (sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3].split(","),
                            sys.argv[4])
prompts = [[1, 2, 3, 4], [40, 41], [7] * 9]
expected = [r.tokens for r in generate_single_process(
    QuantizedStage(load_quantized(model)), prompts, SamplingConfig(max_tokens=12), max_len=64)]
pmetal.init(address=address, psk=psk, namespace="lab",
            config=load_config(transport={"request_timeout": 10.0}))
runs = {}
for placement in (ids, ids[:2], ids[:1]):
    with Pipeline.from_pretrained(model, stages=len(placement), placement=placement,
                                  max_len=64, threads=1, progress=sys.stderr) as pipe:
        got = [r.tokens for r in pipe.generate(prompts, max_tokens=12, chat=False)]
        runs[len(placement)] = {"equal": got == expected, "got": got,
                                "ranges": [[p.start, p.end] for p in pipe.placements],
                                "pulled": [i["pulled"] for i in pipe.loaded],
                                "from": [sorted(i["pulled_from"]) for i in pipe.loaded]}
print(json.dumps({"step": "done", "expected": expected, "runs": runs}), flush=True)
pmetal.shutdown()
"""

PULLER = r"""
import json, sys
from pmetal.config import load_config, pmetal_home
from pmetal.security import NetworkNamespace
from pmetal.store import PieceStore
from pmetal.store.pull import Puller

sha, psk, sources = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3].split(",")
paused = []

def progress(p):
    if p.note:
        print(json.dumps({"step": "note", "note": p.note}), flush=True)
    elif not paused:
        paused.append(p.source)
        print(json.dumps({"step": "first", "source": p.source}), flush=True)
        sys.stdin.readline()            # the test kills the member now

store = PieceStore(pmetal_home() / "models")
config = load_config(transport={"request_timeout": 2.0, "handshake_timeout": 2.0})
try:
    with Puller(store, sources, namespace=NetworkNamespace("lab", psk), config=config,
                progress=progress) as puller:
        result = puller.pull(sha)
    out = {"step": "pulled", "sources": result.sources, "bytes": result.pulled,
           "whole": result.folder.info().complete}
except Exception as exc:
    out = {"step": "pulled", "error": f"{type(exc).__name__}: {exc}",
           "stored": [m.sha256 for m in store.list()]}
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabCluster, Path, str]]:
    tmp = tmp_path_factory.mktemp("storelab")
    for i in HOSTS:
        (tmp / f"h{i}").mkdir(mode=0o700)
    model = tmp / "h1" / "incoming" / "tiny.gguf"
    model.parent.mkdir()
    write_tiny_gguf(model, tiny_config(layers=6), seed=11)
    with PrivateHomesLab(len(HOSTS), tmp) as netlab:
        c = LabCluster(netlab, tmp, discovery=False)
        try:
            c.start_many(HOSTS)
            c.wait(lambda: c.agreed(HOSTS, members=HOSTS), 30.0, "3 members agreed")
            yield c, model, hashlib.sha256(model.read_bytes()).hexdigest()
        finally:
            c.close()


def run_on(c: LabCluster, index: int, code: str, *args: str) -> dict[str, Any]:
    proc = c.lab.python(index, code, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=c._env(index, c.psk), cwd=ROOT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


def test_hosts_do_not_see_each_others_homes(lab: tuple[LabCluster, Path, str]) -> None:
    c, model, _ = lab
    code = ("import json, os, sys\n"
            "print(json.dumps({p: os.path.exists(p) for p in sys.argv[1:]}))\n")
    seen = run_on(c, 2, code, str(model), str(c.tmp / "h2"), str(c.tmp / "h1" / "incoming"))
    assert seen == {str(model): False, str(c.tmp / "h2"): True,
                    str(c.tmp / "h1" / "incoming"): False}
    assert run_on(c, 1, code, str(model))[str(model)] is True


def test_stages_take_their_share_and_answer_as_one_process(
        lab: tuple[LabCluster, Path, str]) -> None:
    c, model, sha = lab
    ids = [c.nodes[i].node_id for i in HOSTS]
    with c.driver(1, DRIVER, [c.nodes[1].address, c.psk.hex(), ",".join(ids), str(model)],
                  "store-driver") as driver:
        done = read_line(driver, 120.0, "done")
        assert driver.wait(timeout=30.0) == 0
    runs = done["runs"]
    print(f"\n[lab] stages' pulls: { {k: r['pulled'] for k, r in runs.items()} }", flush=True)
    assert all(r["equal"] for r in runs.values()), done
    three = runs["3"]
    # Host 1 had it all; hosts 2 and 3 took their layers from host 1's node.
    assert three["pulled"][0] == 0 and three["pulled"][1] > 0 and three["pulled"][2] > 0
    assert three["from"][1] == three["from"][2] == [c.nodes[1].address]
    config = load_config(model)
    size = model.stat().st_size
    held = {}
    for host, (start, end) in zip((2, 3), three["ranges"][1:], strict=True):
        folder = PieceStore(c.tmp / f"h{host}" / "models").open(sha)
        assert folder is not None
        names = {HEADER, *stage_tensors(folder.manifest.by_name, config, start, end)}
        if host == 2:
            # The 2-stage pipeline then gave host 2 the last layers too.
            start2, end2 = runs["2"]["ranges"][1]
            names |= set(stage_tensors(folder.manifest.by_name, config, start2, end2))
        got = {p.name for p, h in zip(folder.manifest.pieces, folder.held(), strict=True) if h}
        assert got == names, host
        held[host] = folder.held_bytes()
        assert held[host] < size
    print(f"[lab] bytes held: host 2 {held[2]}, host 3 {held[3]} of {size}", flush=True)
    assert held[3] == three["pulled"][2]


def test_the_cli_pulls_from_the_lan_and_a_killed_member_hands_over(
        lab: tuple[LabCluster, Path, str]) -> None:
    c, model, sha = lab
    one, two = c.nodes[1].address, c.nodes[2].address
    proc = c.lab.run(2, [sys.executable, "-m", "pmetal", "models", "pull", sha, "--from", one],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     env=c._env(2, c.psk), cwd=ROOT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == str(c.tmp / "h2" / "models" / sha / "tiny.gguf")
    assert "whole file checked" in err.decode()
    # Host 3 pulls from host 2, whose node dies after its first piece.
    with c.driver(3, PULLER, [sha, c.psk.hex(), f"{two},{one}"], "store-puller",
                  stdin=True) as puller:
        assert puller.stdin is not None
        first = read_line(puller, 30.0, "first")
        assert first["source"] == two
        c.nodes[2].proc.kill()
        c.nodes[2].proc.wait(timeout=10)
        puller.stdin.write(b"go\n")
        puller.stdin.flush()
        note = read_line(puller, 30.0, "note")
        assert two in note["note"] and "resuming" in note["note"], note
        done = read_line(puller, 30.0, "pulled")
    print(f"\n[lab] host 3 pulled {done.get('sources')} after host 2 died", flush=True)
    assert done.get("whole") is True, done
    assert done["sources"][two] > 0 and done["sources"][one] > 0
    assert (c.tmp / "h3" / "models" / sha / "tiny.gguf").read_bytes() == model.read_bytes()


def test_a_stranger_without_the_psk_gets_nothing(lab: tuple[LabCluster, Path, str]) -> None:
    c, _model, sha = lab
    stranger = secrets.token_bytes(32)
    home = c.tmp / "h3" / "stranger"
    home.mkdir()
    env = {**c._env(3, c.psk), "PMETAL_HOME": str(home)}
    before = c.status(1)["store"]
    proc = c.lab.python(3, PULLER, sha, stranger.hex(), c.nodes[1].address,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    done = json.loads(out.decode().splitlines()[-1])
    assert done["error"].startswith("ModelUnavailableError"), done
    assert c.nodes[1].address in done["error"] and "did not answer" in done["error"]
    assert done["stored"] == [] and not (home / "models").exists()
    assert c.status(1)["store"] == before          # host 1's node served it nothing
