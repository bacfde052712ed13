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

