"""Lower layers never import higher ones.

The runtime (``pmetal.actors``) reads the current client from
``pmetal.actors.context``; only the public facade (``pmetal.api``, and the
package root that re-exports it) sets it. An import of the facade from
below would bring back the import loop through ``pmetal/api.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pmetal

PACKAGE = Path(pmetal.__file__).parent
# Modules allowed to import the facade: the root re-exports it, the CLI (the
# ``pmetal/cli/`` package) and ``python -m pmetal`` are front ends like it.
FRONT = {"pmetal/__init__.py", "pmetal/api.py", "pmetal/__main__.py",
         *(str(p.relative_to(PACKAGE.parent)) for p in (PACKAGE / "cli").glob("*.py"))}
BELOW = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if str(p.relative_to(PACKAGE.parent)) not in FRONT)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_runtime_modules_are_found() -> None:
    assert "pmetal/actors/handles.py" in BELOW
    assert "pmetal/actors/refs.py" in BELOW
    assert "pmetal/actors/context.py" in BELOW


@pytest.mark.parametrize("module", BELOW)
def test_no_module_below_the_facade_imports_it(module: str) -> None:
    imports = imported_modules(PACKAGE.parent / module)
    assert "pmetal.api" not in imports, f"{module} imports the public facade pmetal.api"


def test_the_context_module_imports_nothing_of_the_runtime() -> None:
    imports = {m for m in imported_modules(PACKAGE / "actors" / "context.py")
               if m.startswith("pmetal")}
    assert imports <= {"pmetal.errors", "pmetal.errors.NotInitializedError",
                       "pmetal.actors.client", "pmetal.actors.client.CoreClient"}


def test_the_codec_imports_nothing_of_shared_memory() -> None:
    """Shared memory plugs into the codec's out-of-band hook from the
    channel layer; the codec itself knows only the hook."""
    for module in ("codec.py", "wire.py"):
        imports = imported_modules(PACKAGE / module)
        shm = {m for m in imports if m == "pmetal.shm" or m.startswith("pmetal.shm.")}
        assert not shm, f"pmetal/{module} imports {sorted(shm)}"



# ------------------------------------------------------------- the contract
#
# Every module belongs to one layer; a layer may import only the layers
# listed for it (and itself). The graph is built from every import
# statement of every module, at the top or inside functions, resolved to
# the module it names (``from pmetal import shm`` is pmetal.shm; ``import
# pmetal`` and ``from pmetal import init`` are the package root, the facade).
#
# core: the root modules below the facade (errors, config, wire, transport,
#   endpoint, channel, security, identity, codec, shm, ...);
# front: the facade (the package root, pmetal.api, pmetal.collective);
# cli: the command line (pmetal.cli, python -m pmetal).
LAYER_OF_ROOT = {"__init__": "front", "api": "front", "collective": "front",
                 "_raylet": "front", "actor": "front", "__main__": "cli"}
ALLOWED = {
    "core": set(),
    "cluster": {"core"},
    "model": {"core"},
    "actors": {"core", "cluster", "store"},   # store: runtime_env working_dir archives
    "store": {"core"},   # model pieces: held by nodes, pulled by stages and the CLI
    # the daemon (the client side never imports it), and its web pages
    "node": {"core", "cluster", "actors", "store", "dashboard"},
    "dashboard": {"core", "cluster"},   # the node's web pages; read the node they are given
    "links": {"core"},   # rank-to-rank links: under both collectives and pipeline
    "collectives": {"core", "cluster", "actors", "links"},
    "pipeline": {"core", "cluster", "actors", "links", "model", "store"},
    "serve": {"core", "pipeline"},   # the HTTP server over a pipeline (pmetal serve)
    "util": {"core", "actors"},   # Ray's import paths (ray.util.*), re-exported
    "dag": {"core", "actors"},   # Ray's import paths (ray.dag.*), re-exported
    "experimental": {"core", "actors"},   # Ray's import paths (ray.experimental.*)
    "front": {"core", "cluster", "actors", "node", "links", "collectives"},
    "bench": {"core", "cluster", "actors", "node", "links", "collectives", "model", "pipeline",
              "serve", "front", "store"},
    "cli": {"core", "cluster", "actors", "node", "links", "collectives", "model", "pipeline",
            "serve", "front", "bench", "store", "dashboard"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "front"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return LAYER_OF_ROOT.get(parts[1], "core")


def resolved_imports(path: Path, source: str | None = None) -> set[str]:
    """The pmetal modules ``path`` imports, each resolved to a module."""
    out: set[str] = set()
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in MODULES else node.module for n in names]
        else:
            continue
        for name in names:
            while name not in MODULES and "." in name:
                name = name.rpartition(".")[0]
            if name in MODULES:
                out.add(name)
    return out


def test_the_contract_knows_every_layer() -> None:
    layers = {layer(m) for m in MODULES}
    assert layers == set(ALLOWED), f"layers without a rule: {layers ^ set(ALLOWED)}"
    assert layer("pmetal.api") == "front" and layer("pmetal.wire") == "core"
    assert layer("pmetal.actors.client") == "actors"
    assert layer("pmetal.node.scheduler") == "node"
    # the resolution the rules depend on
    source = ("import pmetal\nfrom pmetal import shm, init\nimport numpy\n"
              "def f():\n    from pmetal.actors.client import CoreClient\n")
    assert resolved_imports(Path("x.py"), source) == {"pmetal", "pmetal.shm",
                                                      "pmetal.actors.client"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_follows_the_layers(module: str) -> None:
    own = layer(module)
    wrong = sorted(f"{target} ({layer(target)})" for target in resolved_imports(MODULES[module])
                   if layer(target) != own and layer(target) not in ALLOWED[own])
    assert not wrong, (f"{module} ({own}) imports {', '.join(wrong)}; {own} may import "
                       f"{', '.join(sorted(ALLOWED[own])) or 'nothing else of pmetal'}")
