"""The records of the running ``pmetal serve`` processes (pmetal/served.py):
written private and whole, read back, and stale ones (a dead process, a
broken file) skipped and deleted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pmetal.served import remove_record, running_servers, serve_folder, write_record


def test_a_record_is_private_and_read_back(tmp_path: Path) -> None:
    path = write_record("http://127.0.0.1:8000", "tiny", "a-key", home=tmp_path)
    assert path.parent == serve_folder(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert serve_folder(tmp_path).stat().st_mode & 0o777 == 0o700
    [record] = running_servers(tmp_path)
    assert (record.url, record.model, record.api_key, record.path) == (
        "http://127.0.0.1:8000", "tiny", "a-key", path)
    assert record.describe()["api_key"] is True and "a-key" not in json.dumps(record.describe())
    remove_record(path)
    remove_record(path)                  # gone already: fine
    assert running_servers(tmp_path) == []


def test_records_of_dead_processes_and_broken_files_are_deleted(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    dead = write_record("http://127.0.0.1:8001", "gone", None, home=tmp_path,
                        pid=int(done.stdout))
    broken = serve_folder(tmp_path) / "77.json"
    broken.write_text("{not json")
    foreign = serve_folder(tmp_path) / "78.json"
    foreign.write_text(json.dumps({"url": "file:///etc/passwd", "model": "x", "pid": 78,
                                   "started": 0, "api_key": None}))
    live = write_record("http://127.0.0.1:8002", "here", None, home=tmp_path)
    assert [r.url for r in running_servers(tmp_path)] == ["http://127.0.0.1:8002"]
    assert not dead.exists() and not broken.exists() and not foreign.exists()
    assert live.exists()
    assert running_servers(tmp_path / "no-home") == []
