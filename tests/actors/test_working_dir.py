"""``runtime_env={"working_dir": path}`` as in Ray: the folder is packed,
stored by its sha256, unpacked once per machine under
``$PMETAL_HOME/runtime_resources/working_dir/<sha256>/``, and the work runs
there with the folder first on ``sys.path``; a missing or altered archive
is refused, and so is a folder that does not exist or is too big.

The module runs its own embedded node with a private ``PMETAL_HOME`` (the
driver, node and workers share it, as on one machine).
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal import PMetalTypeError, PMetalValueError, RuntimeEnvSetupError
from pmetal.actors import workdir

from .conftest import WAIT, shutdown_quietly


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if pmetal.is_initialized():
        shutdown_quietly()
    home = tmp_path_factory.mktemp("home")
    old = os.environ.get("PMETAL_HOME")
    os.environ["PMETAL_HOME"] = str(home)
    try:
        pmetal.init(num_workers=2)
        yield home
    finally:
        shutdown_quietly()
        if old is None:
            os.environ.pop("PMETAL_HOME", None)
        else:
            os.environ["PMETAL_HOME"] = old


def make_folder(root: Path, marker: str) -> Path:
    """A folder with a module only it has (``wd_helper_<marker>``) and a data file."""
    root.mkdir()
    (root / f"wd_helper_{marker}.py").write_text(textwrap.dedent(f"""
        import os
        MARK = {marker!r}
        def where():
            return os.getcwd()
        class Tool:
            def mark(self):
                return MARK
    """))
    (root / "data.txt").write_text(f"data of {marker}")
    (root / "skip.log").write_text("excluded")
    return root


def unpacked(home: Path) -> list[str]:
    base = home / "runtime_resources" / "working_dir"
    return sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) \
        if base.is_dir() else []


@pmetal.remote
def in_folder(module: str) -> dict[str, Any]:
    mod = __import__(module)
    return {"mark": mod.MARK, "cwd": os.getcwd(), "where": mod.where(),
            "data": Path("data.txt").read_text(), "first": sys.path[0],
            "files": sorted(os.listdir("."))}


@pmetal.remote
def plain_cwd() -> str:
    return os.getcwd()


def test_a_task_imports_a_module_that_only_the_working_dir_has(home: Path,
                                                             tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "wd", "a")
    task = in_folder.options(runtime_env={"working_dir": str(folder), "excludes": ["*.log"]})
    got = pmetal.get(task.remote("wd_helper_a"), timeout=WAIT)
    sha = workdir.publish(str(folder), ["*.log"], "test")["sha256"]
    place = str(home / "runtime_resources" / "working_dir" / sha)
    assert got["mark"] == "a" and got["data"] == "data of a"
    assert got["cwd"] == got["where"] == got["first"] == place
    assert "skip.log" not in got["files"]   # excluded
    # the task worker's own directory is back for a task without one
    assert pmetal.get(plain_cwd.remote(), timeout=WAIT) != place


def test_an_actor_runs_in_the_working_dir_for_its_life(home: Path, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "wd", "b")

    @pmetal.remote(runtime_env={"working_dir": str(folder)})
    class Holder:
        def __init__(self) -> None:
            import wd_helper_b
            self.tool = wd_helper_b.Tool()

        def state(self) -> tuple[str, str]:
            return self.tool.mark(), os.getcwd()

    actor = Holder.remote()
    mark, cwd = pmetal.get(actor.state.remote(), timeout=WAIT)
    assert mark == "b" and Path(cwd).parent == home / "runtime_resources" / "working_dir"
    pmetal.kill(actor)


def test_the_same_folder_sent_twice_is_unpacked_once(home: Path, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "wd", "c")
    env = {"working_dir": str(folder)}
    first = pmetal.get(in_folder.options(runtime_env=env).remote("wd_helper_c"), timeout=WAIT)
    before = unpacked(home)
    # A file left in the unpacked folder survives: nothing unpacks it again,
    # from another remote function, nor from the same one again.
    Path(first["cwd"], "left-here").write_text("x")
    again = pmetal.get(in_folder.options(runtime_env=env).remote("wd_helper_c"), timeout=WAIT)
    assert again["cwd"] == first["cwd"] and "left-here" in again["files"]
    assert unpacked(home) == before


def test_init_runtime_env_working_dir_applies_to_every_task(home: Path, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "wd", "d")
    shutdown_quietly()
    try:
        pmetal.init(num_workers=1, runtime_env={"working_dir": str(folder)})
        got = pmetal.get(in_folder.remote("wd_helper_d"), timeout=WAIT)
        assert got["mark"] == "d"
    finally:
        shutdown_quietly()
        pmetal.init(num_workers=2)


def test_a_tampered_archive_is_refused(home: Path, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "wd", "e")
    spec = workdir.publish(str(folder), None, "test")
    stored = home / "models" / spec["sha256"] / "working_dir.zip"
    data = bytearray(stored.read_bytes())
    data[-30] ^= 0xFF   # same size, other bytes
    stored.unlink()     # (a hard link to the packed file: write a new one)
    stored.write_bytes(bytes(data))
    task = in_folder.options(runtime_env={"working_dir": str(folder)})
    with pytest.raises(RuntimeEnvSetupError, match="altered or damaged"):
        pmetal.get(task.remote("wd_helper_e"), timeout=WAIT)
    assert spec["sha256"] not in unpacked(home)


def test_an_absent_archive_is_refused(home: Path, tmp_path: Path) -> None:
    import shutil

    from pmetal.store import PieceStore
    folder = make_folder(tmp_path / "wd", "f")
    task = in_folder.options(runtime_env={"working_dir": str(folder)})
    spec = workdir.publish(str(folder), None, "test")
    first = pmetal.get(task.remote("wd_helper_f"), timeout=WAIT)
    # Gone from everywhere after the call was made once: the worker has
    # nowhere to take it from.
    shutil.rmtree(first["cwd"])
    assert PieceStore(home / "models").remove(spec["sha256"])
    with pytest.raises(RuntimeEnvSetupError, match="could not be had"):
        pmetal.get(task.remote("wd_helper_f"), timeout=WAIT)
    # Gone before the first call: the driver says so at .remote().
    other = make_folder(tmp_path / "wd2", "f2")
    late = in_folder.options(runtime_env={"working_dir": str(other)})
    assert PieceStore(home / "models").remove(workdir.publish(str(other), None, "t")["sha256"])
    with pytest.raises(RuntimeEnvSetupError, match="does not hold it"):
        late.remote("wd_helper_f2")


def test_code_from_a_module_of_the_working_dir_travels_by_reference(home: Path,
                                                                    tmp_path: Path) -> None:
    """As a Ray script run from its project folder: the function and the
    class come from a module there; the workers import them from their copy."""
    folder = make_folder(tmp_path / "wd", "h")
    sys.path.insert(0, str(folder))
    try:
        import wd_helper_h  # type: ignore[import-not-found]
        env = {"working_dir": str(folder)}
        where = pmetal.remote(wd_helper_h.where).options(runtime_env=env)
        assert Path(pmetal.get(where.remote(), timeout=WAIT)).parent == (
            home / "runtime_resources" / "working_dir")
        tool = pmetal.remote(wd_helper_h.Tool).options(runtime_env=env).remote()
        assert pmetal.get(tool.mark.remote(), timeout=WAIT) == "h"
        pmetal.kill(tool)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("wd_helper_h", None)


def test_a_missing_or_too_big_folder_is_refused_at_options_time(home: Path,
                                                                tmp_path: Path) -> None:
    with pytest.raises(PMetalValueError, match="does not exist"):
        in_folder.options(runtime_env={"working_dir": str(tmp_path / "nowhere")})
    with pytest.raises(PMetalValueError, match="does not exist"):
        pmetal.init(runtime_env={"working_dir": str(tmp_path / "nowhere")})
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "huge.bin", "wb") as f:
        f.truncate(workdir.MAX_BYTES + 1)   # sparse: nothing is written
    with pytest.raises(PMetalValueError, match="over the limit of 100 MiB"):
        in_folder.options(runtime_env={"working_dir": str(big)})
    # excluded, it fits
    in_folder.options(runtime_env={"working_dir": str(big), "excludes": ["*.bin"]})
    with pytest.raises(PMetalTypeError, match="excludes"):
        in_folder.options(runtime_env={"working_dir": str(big), "excludes": "*.bin"})
    with pytest.raises(PMetalValueError, match="is a URI"):
        in_folder.options(runtime_env={"working_dir": "s3://bucket/project.zip"})
    archive = tmp_path / "project.zip"
    archive.write_bytes(b"PK")
    with pytest.raises(PMetalValueError, match="unzip it"):
        in_folder.options(runtime_env={"working_dir": str(archive)})
    with pytest.raises(PMetalValueError, match="'pip' not supported"):
        in_folder.options(runtime_env={"pip": ["requests"]})


def test_packing_is_deterministic(tmp_path: Path) -> None:
    one = make_folder(tmp_path / "one", "g")
    two = make_folder(tmp_path / "two", "g")
    os.utime(two / "data.txt", (1, 1))   # other times, same bytes: same archive
    listing = workdir._listing(one, ())
    a, b = tmp_path / "a.zip", tmp_path / "b.zip"
    assert workdir._pack(listing, a) == workdir._pack(workdir._listing(two, ()), b)
    assert a.read_bytes() == b.read_bytes()


def test_a_task_waiting_for_its_placement_group_runs_in_the_working_dir(
        home: Path, tmp_path: Path) -> None:
    from pmetal.util import placement_group, remove_placement_group
    from pmetal.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    folder = make_folder(tmp_path / "wd", "pg")
    cpus = pmetal.available_resources()["CPU"]
    first = placement_group([{"CPU": cpus}])
    assert first.wait(WAIT)
    second = placement_group([{"CPU": cpus}])   # pending until the first is removed
    try:
        assert second.wait(0.1) is False
        task = in_folder.options(runtime_env={"working_dir": str(folder)},
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(second))
        ref = task.remote("wd_helper_pg")
        remove_placement_group(first)
        assert pmetal.get(ref, timeout=WAIT)["mark"] == "pg"
    finally:
        remove_placement_group(second)
