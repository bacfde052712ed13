"""Where the ``pmetal serve`` processes of this machine listen: one record
each in ``$PMETAL_HOME/serve/``.

What it owns: the records' folder and format. ``pmetal serve`` writes its
record (:func:`write_record`) once it listens and removes it
(:func:`remove_record`) when it stops; a node's dashboard reads them
(:func:`running_servers`) to find a server for its chat page, whose
requests it forwards there (pmetal/dashboard/chat.py). A file rather than a
message to a node: the server may run its own embedded node or join a
daemon's, and the daemon of this machine finds it either way, as long as
both run with the same ``PMETAL_HOME``.

A record whose process is gone (the server was killed) is stale: the
reader skips and deletes it. A recycled pid passes this check; the
dashboard then finds nothing answering at the recorded address, and says
so. A record holds the server's API key (the dashboard sends it on the
user's behalf), so the folder is 0700 and each record 0600, as the node's
key pair is.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmetal.config import pmetal_home

__all__ = ["ServeRecord", "remove_record", "running_servers", "serve_folder", "write_record"]


@dataclass(frozen=True)
class ServeRecord:
    """One running ``pmetal serve``: its base ``url`` (``http://host:port``,
    the API under ``/v1``), the ``model`` id it answers to, its ``pid``,
    when it ``started`` (Unix time) and its ``api_key`` (None: no key)."""

    url: str
    model: str
    pid: int
    started: float
    api_key: str | None
    path: Path

    def describe(self) -> dict[str, Any]:
        """The record without its key (what a page may see)."""
        return {"url": self.url, "model": self.model, "pid": self.pid,
                "started": self.started, "api_key": self.api_key is not None}


def serve_folder(home: Path | None = None) -> Path:
    """``$PMETAL_HOME/serve``: one ``<pid>.json`` per running server."""
    return (pmetal_home() if home is None else home) / "serve"


def write_record(url: str, model: str, api_key: str | None, *, home: Path | None = None,
                 pid: int | None = None) -> Path:
    """Record a server that listens at ``url``; returns the record's path
    (written whole, then renamed, so a reader never sees half of it)."""
    folder = serve_folder(home)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    pid = os.getpid() if pid is None else pid
    path = folder / f"{pid}.json"
    body = json.dumps({"url": url, "model": model, "pid": pid, "started": time.time(),
                       "api_key": api_key})
    part = folder / f".{pid}.json.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(body)
    os.replace(part, path)
    return path


def remove_record(path: Path) -> None:
    """Remove a record (gone already is fine)."""
    path.unlink(missing_ok=True)


def running_servers(home: Path | None = None) -> list[ServeRecord]:
    """The records of the servers whose process lives, oldest first; stale
    and unreadable records are deleted."""
    folder = serve_folder(home)
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return []
    found = []
    for path in paths:
        record = _read(path)
        if record is None or not _alive(record.pid):
            remove_record(path)
            continue
        found.append(record)
    return sorted(found, key=lambda r: r.started)


def _read(path: Path) -> ServeRecord | None:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    url, model, pid = info.get("url"), info.get("model"), info.get("pid")
    started, key = info.get("started"), info.get("api_key")
    if not (isinstance(url, str) and url.startswith("http://") and isinstance(model, str)
            and type(pid) is int and isinstance(started, (int, float))
            and (key is None or isinstance(key, str))):
        return None
    return ServeRecord(url=url, model=model, pid=pid, started=float(started), api_key=key,
                       path=path)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True        # another user's: alive, its address tells the rest
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True        # no /proc (macOS): os.kill said it lives
