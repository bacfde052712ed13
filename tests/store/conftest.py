"""Fixtures of the model store's tests: a tiny GGUF model, and node daemons
on loopback, each with a PMETAL_HOME of its own (its own store), started as
real processes."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pmetal.config import load_config
from pmetal.pipeline.models import ModelStore
from pmetal.security import NetworkNamespace
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "store-test"


@dataclass(eq=False)
class NodeProc:
    home: Path
    address: str
    node_id: str
    proc: subprocess.Popen[bytes]

    @property
    def store(self) -> ModelStore:
        return ModelStore(self.home / "models")

    def served(self, namespace: NetworkNamespace) -> dict[str, int]:
        """The node's store statistics (``status()["store"]``), asked by a member."""
        from pmetal.actors.client import CoreClient

        client = CoreClient(self.address, namespace, load_config())
        try:
            return client.status()["store"]
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the daemon (its workers follow it: they watch its pipe)."""
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_gguf(path, tiny_config(layers=6), seed=3)
    return path


@pytest.fixture()
def psk() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture()
def namespace(psk: bytes) -> NetworkNamespace:
    return NetworkNamespace(NAMESPACE, psk)


@pytest.fixture()
def config():  # type: ignore[no-untyped-def]
    return load_config(transport={"request_timeout": 1.5, "handshake_timeout": 1.5})


@pytest.fixture()
def start_node(tmp_path: Path, psk: bytes) -> Iterator[Callable[[str], NodeProc]]:
    """Start a node daemon on 127.0.0.1 whose home is ``tmp_path/<name>``
    (static ``peers``: the addresses of nodes started before it)."""
    from pmetal.node.daemon import read_ready_line

    started: list[NodeProc] = []

    def start(name: str, peers: tuple[str, ...] = ()) -> NodeProc:
        home = tmp_path / name
        home.mkdir(mode=0o700, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
        env.update(PMETAL_HOME=str(home), PMETAL_PSK_HEX=psk.hex(),
                   PMETAL_SECURITY_NAMESPACE=NAMESPACE, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(
            [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1", "--port", "0",
             "--no-discovery", "--num-workers", "2", "--num-task-workers", "1",
             *(["--peers", ",".join(p.removeprefix("tcp://") for p in peers)] if peers else [])],
            stdout=subprocess.PIPE, stderr=(home / "node.log").open("wb"),
            stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        address, node_id = read_ready_line(proc, 30.0).split()[1:3]
        node = NodeProc(home, address, node_id, proc)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            if node.proc.poll() is None:
                node.proc.terminate()
        for node in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(timeout=5)
            if node.proc.stdout is not None:
                node.proc.stdout.close()
