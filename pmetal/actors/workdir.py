"""Ray's ``runtime_env={"working_dir": path}``: a folder shipped to every
machine that runs the work, checked by its sha256.

Driver side (:func:`publish`, at ``pmetal.init`` or ``.options`` time): the
folder is packed into a deterministic zip (files in sorted order, fixed
times and modes, so one folder always makes the same bytes), refused when
it does not exist or holds more than :data:`MAX_BYTES` (Ray's 100 MiB;
``excludes`` patterns leave files out), and stored in this machine's model
store (``$PMETAL_HOME/models``, :mod:`pmetal.store`) under its sha256, with
a manifest of 4 MiB pieces. The node of this machine serves it from there
like any stored model: to any member of the namespace, over the
namespace's authenticated channels, never to a stranger.

Worker side (:func:`ensure`): a worker that runs work with a working_dir
finds ``$PMETAL_HOME/runtime_resources/working_dir/<sha256>/`` (its node's
home), or makes it: it takes the archive from its node's store, pulling it
first from the driver's node (then the other members) when the store lacks
it, each piece checked against the manifest the driver named by digest; the
whole archive is checked against its sha256 before it is unpacked (a
tampered or truncated archive is refused, nothing is unpacked), into a
temporary folder renamed into place, so a folder is unpacked once per hash
per machine, whoever asks first. An actor runs with the folder as its
current directory and first on ``sys.path`` for its life; a task for its
call (the worker's own are restored after it; modules it imported stay
imported, since the task worker is shared).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import stat
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path, PurePosixPath
from typing import Any

from pmetal.config import pmetal_home
from pmetal.errors import (
    PMetalError,
    PMetalTypeError,
    PMetalValueError,
    RuntimeEnvSetupError,
)
from pmetal.wire import Pickled

__all__ = ["MAX_BYTES", "WorkingDirTask", "check_spec", "ensure", "enter", "publish",
           "sources"]

MAX_BYTES = 100 << 20
"""The most bytes of files a working_dir may hold (Ray's limit)."""

_PIECE = 4 << 20          # bytes per piece of the archive's manifest
_EPOCH = (1980, 1, 1, 0, 0, 0)   # every entry's time: the same folder, the same bytes
_FILENAME = "working_dir.zip"
_lock = threading.Lock()
_published: dict[tuple[Any, ...], dict[str, Any]] = {}   # by folder, excludes and listing


# ------------------------------------------------------------- the driver

def _excluded(rel: PurePosixPath, is_dir: bool, excludes: tuple[str, ...]) -> bool:
    """Whether ``rel`` matches one of ``excludes`` (gitignore-like: a
    pattern with a "/" inside matches the path from the top, one without
    matches any component; a trailing "/" matches folders only)."""
    for pattern in excludes:
        folder_only = pattern.endswith("/")
        body = pattern.rstrip("/")
        if folder_only and not is_dir:
            continue
        if "/" in body:
            if fnmatch.fnmatchcase(rel.as_posix(), body.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(rel.name, body):
            return True
    return False


def _listing(root: Path, excludes: tuple[str, ...]) -> list[tuple[str, Path, os.stat_result]]:
    """The files to pack: (archive name, path, stat), sorted by name."""
    out = []
    for top, dirs, files in os.walk(root):
        here = PurePosixPath(Path(top).relative_to(root).as_posix())
        dirs[:] = sorted(d for d in dirs if not _excluded(here / d, True, excludes))
        for name in files:
            rel = here / name
            if _excluded(rel, False, excludes):
                continue
            path = Path(top) / name
            st = path.stat()   # follows a link: its target's bytes are packed
            if stat.S_ISREG(st.st_mode):
                out.append((rel.as_posix(), path, st))
    out.sort(key=lambda e: e[0])
    return out


def _pack(listing: list[tuple[str, Path, os.stat_result]], target: Path) -> str:
    """Write the zip of ``listing`` to ``target``; its sha256."""
    with zipfile.ZipFile(target, "w") as archive:
        for name, path, st in listing:
            info = zipfile.ZipInfo(name, _EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            mode = 0o755 if st.st_mode & 0o111 else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            with open(path, "rb") as src, archive.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def publish(folder: Any, excludes: Any, where: str) -> dict[str, Any]:
    """Pack ``folder`` and store it in this machine's store; the spec that
    travels with the work: ``{"sha256", "digest", "size"}`` (the sources
    are added when a call is made). Raises PMetalValueError/PMetalTypeError
    saying what is wrong (no such folder, too big, bad excludes)."""
    if not isinstance(folder, (str, os.PathLike)):
        raise PMetalTypeError(f"{where}: runtime_env['working_dir'] must be the path of a "
                              f"folder (a str), not {type(folder).__name__} {folder!r:.40}")
    if excludes is None:
        excludes = ()
    if isinstance(excludes, str) or not isinstance(excludes, (list, tuple)) or not all(
            isinstance(e, str) and e for e in excludes):
        raise PMetalTypeError(f"{where}: runtime_env['excludes'] must be a list of "
                              f"patterns (non-empty str), not {excludes!r:.60}")
    if "://" in str(folder):
        raise PMetalValueError(f"{where}: runtime_env['working_dir'] {str(folder)!r} is a URI; "
                               f"pmetal ships local folders only (it fetches nothing from "
                               f"s3://, gs:// or https://): download and unpack it first")
    root = Path(folder).expanduser()
    if root.is_file() and root.suffix == ".zip":
        raise PMetalValueError(f"{where}: runtime_env['working_dir'] {str(folder)!r} is a zip "
                               f"file; pmetal ships folders only: unzip it and give the folder")
    if not root.is_dir():
        raise PMetalValueError(f"{where}: runtime_env['working_dir'] {str(folder)!r} is not a "
                               f"folder ({'it does not exist' if not root.exists() else 'a file'}"
                               f"); give the path of the folder to ship to the workers")
    root = root.resolve()
    listing = _listing(root, tuple(excludes))
    total = sum(st.st_size for _, _, st in listing)
    if total > MAX_BYTES:
        biggest = sorted(listing, key=lambda e: -e[2].st_size)[:3]
        raise PMetalValueError(
            f"{where}: runtime_env['working_dir'] {str(root)!r} holds {total / 2**20:.1f} MiB "
            f"of files, over the limit of {MAX_BYTES >> 20} MiB (Ray's); the largest: "
            f"{', '.join(f'{n} ({st.st_size / 2**20:.1f} MiB)' for n, _, st in biggest)}. "
            f"Leave data out with runtime_env['excludes'] (patterns) and read it from a "
            f"path every machine has")
    key = (str(root), tuple(excludes),
           tuple((n, st.st_size, st.st_mtime_ns, st.st_ino) for n, _, st in listing))
    with _lock:
        spec = _published.get(key)
        if spec is None:
            spec = _store(listing, where)
            _published[key] = spec
    return dict(spec)


def _store(listing: list[tuple[str, Path, os.stat_result]], where: str) -> dict[str, Any]:
    from pmetal.store import PieceStore, build_manifest
    home = pmetal_home()
    packs = home / "runtime_resources" / "packs"
    packs.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="working_dir-", suffix=".zip", dir=packs)
    os.close(fd)
    staged = Path(name)
    try:
        sha = _pack(listing, staged)
        size = staged.stat().st_size
        cuts = range(_PIECE, size, _PIECE) if size > _PIECE else [size // 2]
        manifest = build_manifest(staged, {f"part{i}": off for i, off in enumerate(cuts)},
                                  filename=_FILENAME, sha256=sha)
        PieceStore(home / "models").add_file(staged, manifest)
    except OSError as exc:
        raise PMetalError(f"{where}: could not pack runtime_env['working_dir'] into "
                          f"{packs}: {exc}") from exc
    finally:
        with suppress(FileNotFoundError):
            staged.unlink()
    return {"sha256": sha, "digest": manifest.digest, "size": size}


_held: set[tuple[str, str]] = set()   # (node id, sha256): that node holds the archive


def sources(spec: dict[str, Any], client: Any, where: str) -> dict[str, Any]:
    """``spec`` with the address that serves it: the node of ``client``,
    which must hold the archive (it shares our PMETAL_HOME: an embedded
    node, or ``pmetal start`` on this machine with the same home). Asked
    once per client and archive; RuntimeEnvSetupError when it does not."""
    sha = spec["sha256"]
    if (client.node_id, sha) not in _held:
        from pmetal.wire import ModelHoldings, ModelQuery
        reply = client.request_node(ModelQuery(sha))
        if not isinstance(reply, ModelHoldings) or not all(bytes(reply.held)):
            raise RuntimeEnvSetupError(
                f"{where}: runtime_env working_dir {sha[:12]} was stored in "
                f"{pmetal_home() / 'models'}, but the node this driver joined "
                f"({client.node_address}) does not hold it: its PMETAL_HOME is another one. "
                f"Run the driver with the node's PMETAL_HOME, or without address= (an "
                f"embedded node)")
        _held.add((client.node_id, sha))
    return {**spec, "sources": [client.node_address]}


def check_spec(spec: Any, where: str) -> None:
    """Check a working_dir spec as it travels (the node checks an actor's)."""
    ok = (isinstance(spec, dict) and isinstance(spec.get("sha256"), str)
          and _is_sha(spec["sha256"]) and isinstance(spec.get("digest"), str)
          and _is_sha(spec["digest"]) and isinstance(spec.get("sources", []), (list, tuple))
          and all(isinstance(s, str) for s in spec.get("sources", [])))
    if not ok:
        raise PMetalValueError(f"{where}: a malformed runtime_env working_dir {spec!r:.120}")


def _is_sha(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


# ------------------------------------------------------------- the worker

def _target(sha: str) -> Path:
    return pmetal_home() / "runtime_resources" / "working_dir" / sha


def ensure(spec: dict[str, Any], client: Any = None) -> Path:
    """The unpacked folder of ``spec`` on this machine, made if missing
    (see the module docstring); RuntimeEnvSetupError saying why not."""
    sha = spec["sha256"]
    target = _target(sha)
    if target.is_dir():
        return target
    from pmetal.store import ChecksumError, ModelError, PieceStore, file_sha256
    store = PieceStore(pmetal_home() / "models")
    what = f"runtime_env working_dir {sha[:12]}"
    try:
        entry = store.open(sha)
        if entry is None or not entry.info().complete:
            _pull(store, spec, client)
            entry = store.open(sha)
        assert entry is not None
        if entry.manifest.digest != spec["digest"]:
            raise RuntimeEnvSetupError(f"{what}: this machine's store ({store.root}) holds "
                                       f"another manifest for it than the driver's; refused")
        got = file_sha256(entry.path)
    except ChecksumError as exc:
        raise RuntimeEnvSetupError(
            f"{what}: the bytes received do not match the archive's sha256 (altered at its "
            f"source or on the way); refused, nothing was unpacked ({exc})") from exc
    except ModelError as exc:
        raise RuntimeEnvSetupError(
            f"{what}: the archive is not on this machine and could not be had from the "
            f"driver's node or another member ({exc}); the driver's node serves it from its "
            f"store ($PMETAL_HOME/models) once pmetal.init/.options packed it there: was it "
            f"removed from there?") from exc
    if got != sha:
        raise RuntimeEnvSetupError(
            f"{what}: the archive in {entry.path} has sha256 {got[:12]}, not {sha[:12]}: it "
            f"was altered or damaged after it was stored; refused (nothing was unpacked). "
            f"Remove it ('pmetal models remove {sha}') and call .options/init again")
    _unpack(entry.path, target, what)
    return target


def _pull(store: Any, spec: dict[str, Any], client: Any) -> None:
    from pmetal.store.pull import Puller
    if client is None:
        from pmetal.actors import context
        client = context.current()
    sources = list(spec.get("sources") or [])
    try:
        info = client.status()
        sources += [m["address"] for m in (info.get("cluster") or {}).get("members") or []
                    if m.get("address")]
    except PMetalError:
        pass   # the driver's node alone, then
    with Puller(store, sources, namespace=client.namespace, config=client.config,
                identity=client.identity) as puller:
        puller.pull(spec["sha256"], None, digest=spec["digest"])


def _unpack(archive: Path, target: Path, what: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name[:12]}-", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                parts = PurePosixPath(info.filename).parts
                if info.filename.startswith("/") or ".." in parts or not parts:
                    raise RuntimeEnvSetupError(f"{what}: the archive holds a path outside "
                                               f"its folder ({info.filename!r}); refused")
                zf.extract(info, staging)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(staging / info.filename, mode)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():   # not another worker that was faster
                raise
    except (OSError, zipfile.BadZipFile) as exc:
        raise RuntimeEnvSetupError(f"{what}: could not unpack into {target}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def enter(folder: Path) -> Callable[[], None]:
    """Make ``folder`` the current directory and the first entry of
    ``sys.path``; returns what undoes it."""
    before = os.getcwd()
    os.chdir(folder)
    entry = str(folder)
    sys.path.insert(0, entry)

    def leave() -> None:
        with suppress(ValueError):
            sys.path.remove(entry)
        with suppress(OSError):
            os.chdir(before)
    return leave


class WorkingDirTask:
    """A remote function that runs in a working_dir: what a task worker
    loads instead of the function itself, so that the function (which may
    live in a module of the folder) is loaded only once the folder is in
    place."""

    def __init__(self, spec: dict[str, Any], inner: Pickled) -> None:
        self.spec = spec
        self.inner = inner
        self._fn: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "inner": self.inner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spec, self.inner, self._fn = state["spec"], state["inner"], None

    def enter(self) -> tuple[Any, Callable[[], None]]:
        """Set the folder up for a call: (the function, what undoes it)."""
        leave = enter(ensure(self.spec))
        try:
            if self._fn is None:
                self._fn = self.inner.load()
        except BaseException:
            leave()
            raise
        return self._fn, leave

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function in the folder (for a wrapper that calls it with
        its arguments already unpacked: a task waiting for its placement group)."""
        fn, leave = self.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            leave()

    def run(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Call the function in the folder with packed arguments."""
        from pmetal.actors.serialization import unpack_value, unpack_values
        fn, leave = self.enter()
        try:
            return fn(*unpack_values(args), **{k: unpack_value(v) for k, v in kwargs.items()})
        finally:
            leave()
