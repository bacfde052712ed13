"""The ``pmetal`` command line: each command in-process, and the real entry points."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pmetal import __version__
from pmetal.cli import COMMANDS, main
from pmetal.config import DEFAULT_PORT, config_as_dict, load_config
from pmetal.identity import KEYPAIR_FILE, NodeIdentity

PSK = "a-secret-psk-that-must-never-be-printed"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private PMETAL_HOME and no stray PMETAL_* variables from the caller."""
    for key in list(os.environ):
        if key.startswith("PMETAL_"):
            monkeypatch.delenv(key)
    folder = tmp_path / "home"
    monkeypatch.setenv("PMETAL_HOME", str(folder))
    return folder


@pytest.fixture(autouse=True)
def pmetal_log_level() -> Iterator[None]:
    """main() may set the pmetal logger's level; give it back after each test."""
    logger = logging.getLogger("pmetal")
    saved = logger.level
    yield
    logger.setLevel(saved)


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(home)
    return env


# ------------------------------------------------------------- --version, usage

def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"pmetal {__version__}\n"


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: pmetal" in err
    for name in COMMANDS:
        assert name in err


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "meant", "usage"), [
    (["stauts"], "'status'", "usage: pmetal "),
    (["lanch", "-n", "2"], "'launch'", "usage: pmetal "),
    (["status", "--jsno"], "'--json'", "usage: pmetal status"),
    (["start", "--prot", "6000"], "'--port'", "usage: pmetal start"),
    (["kill", "x", "--restrat"], "'--restart'", "usage: pmetal kill"),
    (["status", "--probbe=1"], "'--probe'", "usage: pmetal status"),
])
def test_a_typo_gets_the_closest_command_or_option(argv: list[str], meant: str, usage: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"did you mean {meant}?" in err and usage in err, err


def test_a_word_like_nothing_known_gets_no_suggestion(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--zzzzqqq"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzqqq" in err and "did you mean" not in err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert name in out
        assert command.help.split()[0] in out


# ------------------------------------------------------------------ logging

@pytest.mark.parametrize("argv, env, level", [
    (["-v", "config"], None, logging.INFO),
    (["-vv", "config"], None, logging.DEBUG),
    (["config"], "debug", logging.DEBUG),
    (["-v", "config"], "ERROR", logging.INFO),
])
def test_log_level_from_flag_or_environment(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                            env: str | None, level: int) -> None:
    if env is not None:
        monkeypatch.setenv("PMETAL_LOG_LEVEL", env)
    assert main(argv) == 0
    assert logging.getLogger("pmetal").level == level


def test_bad_log_level_is_a_configuration_error(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PMETAL_LOG_LEVEL", "chatty")
    assert main(["config"]) == 2
    assert "PMETAL_LOG_LEVEL" in capsys.readouterr().err


# ------------------------------------------------------------------- config

def test_config_text_lists_every_section_and_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    for section, values in config_as_dict(load_config(env={})).items():
        assert f"[{section}]" in out
        for name, value in values.items():
            assert f"{name} = {json.dumps(value)}" in out


def test_config_json_applies_environment(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PMETAL_TRANSPORT_PORT", "6000")
    monkeypatch.setenv("PMETAL_SECURITY_ENCRYPT", "yes")
    assert main(["config", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = config_as_dict(load_config(env={}, transport={"port": 6000},
                                          security={"encrypt": True}))
    assert printed == expected
    assert expected["transport"]["port"] != DEFAULT_PORT


def test_config_marks_environment_overrides(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PMETAL_TRANSPORT_REQUEST_TIMEOUT", "0.5")
    assert main(["config"]) == 0
    assert "request_timeout = 0.5  # from PMETAL_TRANSPORT_REQUEST_TIMEOUT" in \
        capsys.readouterr().out


@pytest.mark.parametrize("as_json", [False, True])
def test_config_never_prints_the_psk(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    monkeypatch.setenv("PMETAL_PSK", PSK)
    assert main(["config", "--json"] if as_json else ["config"]) == 0
    captured = capsys.readouterr()
    assert PSK not in captured.out + captured.err
    if not as_json:
        assert "PMETAL_PSK (not shown)" in captured.out


@pytest.mark.parametrize("name, value", [("PMETAL_TRANSPORT_PORTT", "1"),
                                         ("PMETAL_TRANSPORT_PORT", "many"),
                                         ("PMETAL_TRANSPORT_PORT", "70000")])
def test_config_bad_variable_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    assert main(["config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "configuration error" in captured.err
    assert "Traceback" not in captured.err


# ----------------------------------------------------------------- identity

def test_identity_creates_then_reloads(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    assert main(["identity"]) == 0
    first = capsys.readouterr().out
    key_file = home / KEYPAIR_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    node_id = NodeIdentity.load_or_create(home).node_id
    assert node_id in first
    assert f"{key_file} (created)" in first

    assert main(["identity"]) == 0
    second = capsys.readouterr().out
    assert node_id in second
    assert "(created)" not in second


def test_identity_home_option(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              home: Path) -> None:
    other = tmp_path / "other"
    assert main(["identity", "--home", str(other)]) == 0
    out = capsys.readouterr().out
    assert str(other / KEYPAIR_FILE) in out
    assert NodeIdentity.load_or_create(other).node_id in out
    assert not home.exists()


def test_identity_unsafe_key_file_is_one_line_error(capsys: pytest.CaptureFixture[str],
                                                    home: Path) -> None:
    NodeIdentity.load_or_create(home)
    (home / KEYPAIR_FILE).chmod(0o644)
    assert main(["identity"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "readable by other users" in captured.err


# ------------------------------------------------------------------- keygen

def test_keygen_prints_a_fresh_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen"]) == 0
    first = capsys.readouterr().out.strip()
    assert main(["keygen"]) == 0
    second = capsys.readouterr().out.strip()
    assert len(first) == 64 and bytes.fromhex(first)
    assert first != second


def test_keygen_out_writes_mode_0600_and_never_overwrites(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "cluster.psk"
    assert main(["keygen", "--out", str(out)]) == 0
    key = out.read_text().strip()
    assert len(key) == 64 and bytes.fromhex(key)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert key not in capsys.readouterr().out

    assert main(["keygen", "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert out.read_text().strip() == key


def test_keygen_out_is_a_usable_psk_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from pmetal.security import NetworkNamespace
    out = tmp_path / "cluster.psk"
    assert main(["keygen", "--out", str(out)]) == 0
    monkeypatch.setenv("PMETAL_SECURITY_PSK_FILE", str(out))
    ns = NetworkNamespace.resolve(load_config().security)
    assert ns.psk == out.read_text().strip().encode()


def test_keygen_unwritable_folder_is_one_line_error(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    assert main(["keygen", "--out", str(tmp_path / "missing" / "k")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot create" in err


# ------------------------------------------------------- real entry points

def _console_script() -> str:
    local = Path(sys.executable).with_name("pmetal")
    found = str(local) if local.exists() else shutil.which("pmetal")
    if found is None:
        pytest.fail("the pmetal console script is not installed; run pip install -e .")
    return found


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30,
                          check=False)


def test_python_dash_m_version(home: Path) -> None:
    done = _run([sys.executable, "-m", "pmetal", "--version"], _clean_env(home))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"pmetal {__version__}\n"
    assert done.stderr == ""


def test_console_script_config(home: Path) -> None:
    env = _clean_env(home) | {"PMETAL_TRANSPORT_PORT": "6001", "PMETAL_PSK": PSK}
    done = _run([_console_script(), "config", "--json"], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["transport"]["port"] == 6001
    assert PSK not in done.stdout + done.stderr


def test_import_prints_nothing(home: Path) -> None:
    done = _run([sys.executable, "-c", "import pmetal, pmetal.cli, pmetal.__main__"],
                _clean_env(home))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_status_text_reads_for_a_person(capsys: pytest.CaptureFixture[str]) -> None:
    # What a node's status() holds, as 'pmetal status' prints it: workers
    # named by what they host, the queue and leases summed up, live actors
    # before the dead, and only the latest dead ones.
    from pmetal.cli.picture import _DEAD_SHOWN, picture
    dead = [{"actor_id": f"d-{i}", "class_name": "Old", "name": f"old{i}", "state": "dead",
             "owner": "pid 1 on abcdef01", "node_id": "abcdef0123", "reason": "its owner exited"}
            for i in range(_DEAD_SHOWN + 5)]
    live = [{"actor_id": "a-1", "class_name": "Trainer", "name": "trainer", "state": "alive",
             "owner": "client 0123abcd via abcdef01", "node_id": "abcdef0123",
             "resources": {"CPU": 1.0}},
            {"actor_id": "a-2", "class_name": "Cache", "name": "", "state": "pending",
             "lifetime": "detached", "node_id": "abcdef0123", "reason": "waiting for resources"}]
    status = {"node_id": "abcdef0123", "address": "tcp://127.0.0.1:1", "pid": 7,
              "resources": {"CPU": 2.0}, "available": {"CPU": 0.0}, "members": [],
              "workers": [{"worker_id": "w0", "pid": 8, "role": "actor", "ready": True,
                           "actor_id": "a-1", "calls": 3},
                          {"worker_id": "w1", "pid": 9, "role": "actor", "ready": True},
                          {"worker_id": "w2", "pid": 10, "role": "task", "ready": True}],
              "actors": dead + live,
              "queue": [{"what": "actor Cache", "needs": {"CPU": 1.0}, "waited": 2.5,
                         "gives_up_in": 27.5}],
              "owner_leases": [{"client": "0123abcd", "expires_in": 20.0}]}
    out = "\n".join(picture(status, 7))
    assert "queue      1 creation(s) waiting for resources (the oldest for 2.5 s)" in out
    assert "leases     1 driver(s) on other machines" in out
    assert "trainer (Trainer)" in out and "idle" in out
    actors = out[out.index("ACTORS"):]
    assert f"ACTORS ({_DEAD_SHOWN + 7})" in actors
    assert actors.index("trainer") < actors.index("old14")       # live first
    assert "old4 " not in actors and "old5 " in actors            # the latest dead only
    assert "5 older dead actors left out" in actors


# ------------------------------------------------------ a read-only home

def _in_read_only(home: Path, argv: list[str], env: dict[str, str]) -> list[str]:
    """``argv`` run with ``home`` read-only: a read-only bind mount in a
    mount namespace of its own for root (whom file modes do not stop), the
    folder's mode for anyone else."""
    home.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        home.chmod(0o555)
        return argv
    if shutil.which("unshare") is None:
        pytest.skip("root needs unshare(1) to make a read-only folder")
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, str(home), *argv]


@pytest.mark.parametrize("command", [
    ["identity"],
    ["start", "--no-discovery", "--port", "0"],
    ["start", "--block", "--no-discovery", "--port", "0"],
    ["generate", "--prompt", "hi", "--max-tokens", "1"],
])
def test_a_read_only_home_is_one_clear_line_naming_it(command: list[str], home: Path) -> None:
    env = _clean_env(home)
    argv = _in_read_only(home, [sys.executable, "-m", "pmetal", *command], env)
    try:
        done = _run(argv, env)
    finally:
        home.chmod(0o755)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"PMETAL_HOME ({home}" in done.stderr and "writable" in done.stderr, done.stderr
    assert done.stderr.startswith(f"pmetal {command[0]}: cannot write in {home}")
    # Nothing was left running for it.
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"PMETAL_HOME={home}\0".encode() in (
                    entry / "environ").read_bytes():
                left.append(int(entry.name))
        except OSError:
            continue
    assert not left, left
