"""The node daemon as a process: its ready line, its ``node.json`` record,
whether a recorded pid is still a live node, and the address it advertises.

Used by whoever starts or finds a node (``pmetal start``, ``pmetal.init``)
without importing the daemon itself.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from pmetal.config import pmetal_home
from pmetal.errors import PMetalError, PMetalTimeoutError
from pmetal.values import Address

__all__ = ["READY_LINE", "is_node_process", "node_file", "read_ready_line", "routable_address"]

READY_LINE = "PMETAL_NODE_READY"


def read_ready_line(proc: Any, timeout: float) -> str:
    """The ``PMETAL_NODE_READY <address> <node id>`` line a node process prints
    on stdout when it serves, read byte by byte (what follows is user output)
    with a deadline. Kills the process when it does not come."""
    import selectors
    deadline = time.monotonic() + timeout
    line = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                proc.kill()
                proc.wait()
                raise PMetalTimeoutError(f"the pmetal node did not report ready within "
                                         f"{timeout:.3g} s")
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                raise PMetalError(f"the pmetal node exited at start (code {proc.wait()}); its "
                                  f"error is printed above")
            line += chunk
    text = line.decode(errors="replace").strip()
    if not text.startswith(READY_LINE + " "):
        proc.kill()
        proc.wait()
        raise PMetalError(f"unexpected output from the pmetal node: {text!r}")
    return text


def node_file(home: Any = None) -> Any:
    """``~/.pmetal/node.json``: where ``address="auto"`` and ``pmetal stop``
    find the daemon running on this machine."""
    return (pmetal_home() if home is None else home) / "node.json"


def is_node_process(pid: Any) -> bool:
    """Whether ``pid`` is a live pmetal node (not a zombie, not a recycled pid):
    a node.json whose pid is gone is stale (the node was killed)."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not ours to manage
    proc = Path(f"/proc/{pid}")
    if proc.is_dir():
        try:
            if proc.joinpath("stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return False
            return b"pmetal.node" in proc.joinpath("cmdline").read_bytes()
        except OSError:
            return False
    try:  # macOS and other systems without /proc
        out = subprocess.run(["ps", "-o", "stat=,command=", "-p", str(pid)], check=False,
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return True  # cannot tell: trust the record
    return bool(out) and not out.startswith("Z") and "pmetal.node" in out


def routable_address(address: str) -> str:
    """``address`` with a wildcard host (0.0.0.0, ::, *) replaced by an
    address of this machine that peers can dial: the one of the interface
    with the default route, else the first non-loopback one, else
    127.0.0.1 (a machine with loopback only)."""
    try:
        parsed = Address.parse(address)
    except ValueError:
        return address   # not tcp://host:port (an inproc:// URL): nothing to replace
    if parsed.host not in ("0.0.0.0", "*", "::"):
        return address
    return Address(_this_machine_address(), parsed.port).url()


def _this_machine_address() -> str:
    # A UDP "connect" sends nothing; it only asks the kernel which source
    # address the default route would use.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))   # TEST-NET-1: never routed anywhere real
            address = probe.getsockname()[0]
        if address and not address.startswith(("0.", "127.")):
            return address
    except OSError:
        pass   # no default route
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not address.startswith("127."):
            return address
    return "127.0.0.1"
