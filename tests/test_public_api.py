"""The curated public surface: sorted ``__all__`` lists that name real
objects, and a package root that stays quiet."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import pmetal

PACKAGE_ROOT = Path(pmetal.__file__).parent
PACKAGES = sorted(
    ".".join(("pmetal", *init.parent.relative_to(PACKAGE_ROOT).parts))
    for init in PACKAGE_ROOT.rglob("__init__.py"))
# Modules whose public names are part of this suite's contract.
MODULES = ["pmetal.actors.context", "pmetal.actors.dag", "pmetal.actors.dynamic",
           "pmetal.actors.handles", "pmetal.actors.tensor_transports", "pmetal.api",
           "pmetal.config", "pmetal.actors.runtime_context", "pmetal.dag.input_node",
           "pmetal.dag.output_node", "pmetal.exceptions", "pmetal.experimental.tqdm_ray",
           "pmetal.errors", "pmetal.hardware", "pmetal.ids", "pmetal.model.kernels",
           "pmetal.util.actor_pool", "pmetal.util.placement_group", "pmetal.util.queue",
           "pmetal.util.scheduling_strategies", "pmetal.wire"]


def test_the_package_list_is_found() -> None:
    assert "pmetal" in PACKAGES
    assert "pmetal.actors" in PACKAGES


def test_root_all_is_sorted() -> None:
    assert pmetal.__all__ == sorted(pmetal.__all__)
    assert len(set(pmetal.__all__)) == len(pmetal.__all__)


@pytest.mark.parametrize("name", pmetal.__all__)
def test_every_root_name_exists(name: str) -> None:
    assert getattr(pmetal, name) is not None


def test_version_is_a_string() -> None:
    assert isinstance(pmetal.__version__, str)
    assert pmetal.__version__.split(".")[0].isdigit()
    assert "__version__" in pmetal.__all__


def test_root_exports_every_error() -> None:
    from pmetal import errors
    assert set(errors.__all__) <= set(pmetal.__all__)


def test_root_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("pmetal").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_star_import_in_a_fresh_process_works_and_prints_nothing() -> None:
    """``from pmetal import *`` fails if ``__all__`` names anything missing."""
    code = "from pmetal import *; import pmetal; assert set(pmetal.__all__) <= set(dir())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.parametrize("name", PACKAGES + MODULES)
def test_all_is_sorted_and_names_real_objects(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list), f"{name} has no __all__ list"
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names missing objects: {missing}"


def test_rays_module_paths_work_after_import_pmetal_alone() -> None:
    """``import pmetal as ray`` then ``ray.util.ActorPool``, ``ray.util.queue``
    and ``ray.exceptions``, as Ray scripts write them, in a fresh process."""
    code = ("import pmetal as ray\n"
            "assert ray.exceptions.RayActorError is ray.ActorDiedError\n"
            "assert ray.util.ActorPool.__name__ == 'ActorPool'\n"
            "assert ray.util.queue.Empty.__name__ == 'Empty'\n"
            "assert callable(ray.get_runtime_context)\n"
            "assert ray.dag.InputNode.__name__ == 'InputNode'\n"
            "assert ray.DynamicObjectRefGenerator.__name__ == 'DynamicObjectRefGenerator'\n"
            "assert callable(ray.experimental.register_tensor_transport)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
