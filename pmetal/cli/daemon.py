"""``pmetal start`` and ``pmetal stop``: the node daemon's lifecycle.

``pmetal start`` runs ``python -m pmetal.node`` and records it in
$PMETAL_HOME/node.json (address, node id, pid, namespace, PSK file), where
``pmetal status``, ``pmetal stop`` and ``pmetal.init(address="auto")`` find it.
In the background the node gets a session of its own and writes its output to
$PMETAL_HOME/node.log; with --block it stays attached to the terminal.

This module holds the commands, the node.json record (write, read, remove)
and the process handling (waiting for the ready line, for an exit, killing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pmetal.node.process import READY_LINE, is_node_process, node_file
from pmetal.cli.basic import _fail, _write_new_key
from pmetal.config import (DEFAULT_PORT, DiscoveryConfig, ElectionConfig, HealthConfig,
                           load_config, pmetal_home)
from pmetal.errors import ConfigError, PMetalError, PMetalTimeoutError
from pmetal.identity import NodeIdentity, check_home, check_private_file
from pmetal.security import NetworkNamespace
from pmetal.transport import normalize_address
from pmetal.values import host_of

# The name docs/logging.md gives the command line's logger, from before the split.
log = logging.getLogger("pmetal.cli")

NODE_LOG = "node.log"
PSK_FILE = "psk"
_READY_TIMEOUT = 30.0
"""Longest wait for a starting node's ready line (it comes before workers start)."""
_STOP_TIMEOUT = 10.0
"""How long a node may take to stop after SIGTERM before it is killed."""


def _start_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None,
                        help="address to listen on (default: transport.host, 127.0.0.1: this "
                             "machine only); give this machine's LAN address to let other "
                             "machines join (the node and its workers advertise it to peers)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to listen on (default: transport.port, {DEFAULT_PORT}; "
                             f"0 picks a free one)")
    parser.add_argument("--namespace", default=None,
                        help="namespace (cluster) name (default: security.namespace)")
    parser.add_argument("--psk-file", type=Path, default=None, metavar="PATH",
                        help="file holding the namespace PSK (default: $PMETAL_PSK, else "
                             "security.psk_file, else $PMETAL_HOME/psk, created on first start)")
    parser.add_argument("--peers", default="", metavar="HOST:PORT,...",
                        help="comma-separated addresses of other nodes to join")
    parser.add_argument("--no-discovery", action="store_true",
                        help="neither announce this node nor look for others with mDNS "
                             "(static --peers still work)")
    parser.add_argument("--interfaces", default=None, metavar="ADDR,...",
                        help="IPv4 addresses of the interfaces mDNS uses (default: the "
                             "address the node listens on; every interface for 0.0.0.0)")
    parser.add_argument("--wifi", action="store_true",
                        help="health and election timeouts for Wi-Fi (a peer is dead after "
                             "5 s of silence instead of 0.8 s)")
    parser.add_argument("--block", action="store_true",
                        help="stay in the foreground until the node stops (Ctrl-C stops it)")


def _run_start(args: argparse.Namespace) -> int:
    home = pmetal_home()
    running = _recorded_node(home)
    if running is not None:
        return _fail(args, f"a node is already running on this machine (pid {running['pid']}, "
                           f"{running['address']}); 'pmetal stop' stops it")
    overrides: dict[str, Any] = {}
    if args.namespace is not None:
        overrides["namespace"] = args.namespace
    transport: dict[str, Any] = {}
    if args.host is not None:
        transport["host"] = args.host
    if args.port is not None:
        transport["port"] = args.port
    cfg = load_config(security=overrides, transport=transport)
    peers = _peer_list(args.peers)
    NodeIdentity.load_or_create(home)  # a bad key file fails here, with its own message
    psk_file = _psk_file_for_start(args.psk_file, cfg.security.psk_file, home)

    env = dict(os.environ)
    env["PMETAL_SECURITY_NAMESPACE"] = cfg.security.namespace
    if psk_file is not None:
        env.pop("PMETAL_PSK", None)  # the node would prefer it to the file
        env["PMETAL_SECURITY_PSK_FILE"] = str(psk_file)
        NetworkNamespace.resolve(replace(cfg.security, psk_file=str(psk_file)), env={})
    else:
        NetworkNamespace.resolve(cfg.security)  # PMETAL_PSK: check it is long enough
    level = logging.getLogger("pmetal").level
    if level and level < logging.WARNING:  # -v / -vv reach the node's log too
        env["PMETAL_LOG_LEVEL"] = logging.getLevelName(level)
    cmd = [sys.executable, "-m", "pmetal.node", "--host", cfg.transport.host,
           "--port", str(cfg.transport.port)]
    if peers:
        cmd += ["--peers", ",".join(peers)]
    cmd += ["--no-discovery" if args.no_discovery else "--discovery"]
    if args.interfaces:
        DiscoveryConfig(interfaces=args.interfaces)   # a typo fails here, with its reason
        cmd += ["--interfaces", args.interfaces]
    if args.wifi:
        for section, preset in (("HEALTH", HealthConfig.wifi()), ("ELECTION", ElectionConfig.wifi())):
            for key, value in preset.__dict__.items():
                env[f"PMETAL_{section}_{key.upper()}"] = str(value)
    record = {"namespace": cfg.security.namespace,
              "psk_file": "" if psk_file is None else str(psk_file)}
    if args.block:
        return _start_foreground(cmd, env, home, record)
    return _start_background(cmd, env, home, record)


def _peer_list(text: str) -> list[str]:
    peers = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            peers.append(normalize_address(item))
        except ValueError as exc:
            raise ConfigError(f"--peers: {exc}") from exc
    return peers


def _psk_file_for_start(given: Path | None, configured: str, home: Path) -> Path | None:
    """The PSK file the node will read, or None when PMETAL_PSK holds the key.

    Order: --psk-file, PMETAL_PSK, security.psk_file, then $PMETAL_HOME/psk,
    made on first start (64 hex characters, mode 0600)."""
    if given is None and os.environ.get("PMETAL_PSK"):
        return None
    if given is None and configured:
        given = Path(configured)
    if given is None:
        path = home / PSK_FILE
        if not path.exists():
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                _write_new_key(path)
                print(f"created a namespace PSK in {path}; copy it to the other machines "
                      f"of this cluster")
            except FileExistsError:
                pass  # another 'pmetal start' made it meanwhile: use theirs
            except OSError as exc:
                raise ConfigError(f"cannot create the PSK file {path}: {exc.strerror}") from exc
        given = path
    path = given.expanduser().absolute()
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the PSK file {path}: {exc.strerror}") from exc
    if mode & 0o077:
        log.warning("the PSK file %s can be read by other users (mode %o); run chmod 600 %s",
                    path, stat.S_IMODE(mode), path)
    return path


def _start_background(cmd: list[str], env: dict[str, str], home: Path,
                      record: dict[str, Any]) -> int:
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = home / NODE_LOG
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    offset = os.fstat(fd).st_size
    try:
        # A session of its own: closing the terminal or Ctrl-C here does not stop it.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env,
                                start_new_session=True)
    finally:
        os.close(fd)
    address, node_id = _await_ready_in_log(proc, log_path, offset)
    info = _write_node_file(home, address, node_id, proc.pid, record)
    _print_started(info, log_path)
    return 0


def _await_ready_in_log(proc: subprocess.Popen[bytes], log_path: Path,
                        offset: int) -> tuple[str, str]:
    """The node's ready line, read from its log; the node is killed when it
    does not come within the deadline.

    The log is a regular file (so the node and its workers can write to it
    after we exit), and regular files are always "readable" to select(): we
    wait on the process for short slices and look at the log in between."""
    deadline = time.monotonic() + _READY_TIMEOUT
    while True:
        with open(log_path, "rb") as f:
            f.seek(offset)
            for line in f.read().decode(errors="replace").splitlines():
                parts = line.split()
                if len(parts) >= 3 and parts[0] == READY_LINE:
                    return parts[1], parts[2]
        if proc.poll() is not None:
            raise PMetalError(f"the node exited at start (code {proc.returncode}):\n"
                              f"{_log_tail(log_path, offset)}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            proc.kill()
            proc.wait()
            raise PMetalTimeoutError(f"the node did not report ready within {_READY_TIMEOUT} s; "
                                     f"see {log_path}")
        try:
            proc.wait(min(0.05, remaining))
        except subprocess.TimeoutExpired:
            pass


def _log_tail(path: Path, offset: int, lines: int = 10) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace").strip().splitlines()
    return "\n".join("  " + line for line in text[-lines:]) or "  (no output)"


def _start_foreground(cmd: list[str], env: dict[str, str], home: Path,
                      record: dict[str, Any]) -> int:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.terminate())
    # "Ctrl-C stops it", even when started from a script or with '&', where
    # the shell hands this process SIGINT ignored (and Python keeps it so).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    path = node_file(home)
    try:
        line = _read_ready_line(proc)
        parts = line.split()
        if len(parts) < 3 or parts[0] != READY_LINE:
            proc.kill()
            raise PMetalError(f"unexpected first line from the node: {line!r}")
        info = _write_node_file(home, parts[1], parts[2], proc.pid, record)
        _print_started(info, None)
        print("Ctrl-C stops it.", flush=True)
        # The node's workers share this stdout: pass user output through until they close it.
        out = sys.stdout.buffer
        while chunk := os.read(proc.stdout.fileno(), 1 << 16):
            out.write(chunk)
            out.flush()
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()  # it had SIGINT too when it shares our terminal; this makes sure
        print("\nstopping the node", file=sys.stderr)
        return 0 if _wait_exit(proc.pid, _STOP_TIMEOUT, proc) else _kill_hard(proc.pid, proc)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        _remove_node_file(path, proc.pid)


def _read_ready_line(proc: subprocess.Popen[bytes]) -> str:
    from pmetal.node.process import read_ready_line
    return read_ready_line(proc, _READY_TIMEOUT)


def _print_started(info: dict[str, Any], log_path: Path | None) -> None:
    print(f"started pmetal node {info['node_id']} (pid {info['pid']})")
    print(f"  address    {info['listen']}")
    print(f"  namespace  {info['namespace']}")
    print(f"  psk        {info['psk_file'] or 'from PMETAL_PSK'}")
    if log_path is not None:
        print(f"  log        {log_path}")
    if _host_of(info["listen"]) in ("127.0.0.1", "localhost", "::1"):
        print("Only this machine can reach it; 'pmetal start --host <LAN address>' lets "
              "other machines join.")
    print('Scripts on this machine connect with pmetal.init(address="auto"); '
          "'pmetal status' shows it, 'pmetal stop' stops it.", flush=True)


def _host_of(address: str) -> str:
    return host_of(address)


def _write_node_file(home: Path, listen: str, node_id: str, pid: int,
                     record: dict[str, Any]) -> dict[str, Any]:
    """Write node.json atomically with mode 0600; return what was written."""
    address = listen
    if _host_of(listen) in ("0.0.0.0", "*", "::"):  # listening everywhere: reach it locally
        address = f"tcp://127.0.0.1:{listen.rpartition(':')[2]}"
    info = {"address": address, "listen": listen, "node_id": node_id, "pid": pid, **record}
    path = node_file(home)
    fd, tmp = tempfile.mkstemp(dir=home, prefix=".node.json.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return info


def _read_node_file(home: Path) -> dict[str, Any] | None:
    path = node_file(home)
    if not path.exists():
        return None
    check_home(home)
    check_private_file(path, "the node record", ConfigError)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise PMetalError(f"cannot read {path}: {exc}; remove it if no node is running")
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int) \
            or not isinstance(info.get("address"), str):
        raise PMetalError(f"{path} is not a node record; remove it if no node is running")
    return info


def _recorded_node(home: Path) -> dict[str, Any] | None:
    """The node recorded in node.json if it still runs; a stale record is removed."""
    info = _read_node_file(home)
    if info is None:
        return None
    if _is_node_process(info["pid"]):
        return info
    _remove_node_file(node_file(home), info["pid"])
    return None


def _remove_node_file(path: Path, pid: int) -> None:
    """Remove node.json if it still describes ``pid`` (a newer node may own it)."""
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


_is_node_process = is_node_process


def _wait_exit(pid: int, timeout: float, child: subprocess.Popen[bytes] | None = None) -> bool:
    """Wait until process ``pid`` exits; False when ``timeout`` passes first.

    Waits on an event where the OS offers one for a process that is not our
    child (a pidfd on Linux, kqueue on macOS), else on short slices."""
    if child is not None:
        try:
            child.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                return bool(sel.select(timeout))
        finally:
            os.close(fd)
    if hasattr(select, "kqueue"):
        kq = select.kqueue()
        try:
            event = select.kevent(pid, filter=select.KQ_FILTER_PROC,
                                  flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT,
                                  fflags=select.KQ_NOTE_EXIT)
            return bool(kq.control([event], 1, timeout))
        except ProcessLookupError:
            return True
        finally:
            kq.close()
    while _is_node_process(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_hard(pid: int, child: subprocess.Popen[bytes] | None = None) -> int:
    print(f"pmetal: the node (pid {pid}) did not stop within {_STOP_TIMEOUT} s; killing it",
          file=sys.stderr)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return 0
    return 0 if _wait_exit(pid, _STOP_TIMEOUT, child) else 1


def _run_stop(args: argparse.Namespace) -> int:
    home = pmetal_home()
    path = node_file(home)
    info = _read_node_file(home)
    if info is None:
        print("no pmetal node is running on this machine")
        return 0
    pid = info["pid"]
    if not _is_node_process(pid):
        _remove_node_file(path, pid)
        print(f"the node recorded in {path} (pid {pid}) was not running; removed the record")
        return 0
    # SIGTERM needs no PSK and works however busy the node's socket is; the
    # node stops its workers and exits.
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    status = 0 if _wait_exit(pid, _STOP_TIMEOUT) else _kill_hard(pid)
    if status == 0:
        _remove_node_file(path, pid)
        print(f"stopped pmetal node {info.get('node_id', '?')} (pid {pid})")
        return 0
    return _fail(args, f"could not stop the node (pid {pid})")
