"""The manifest and a model's folder: pieces that tile the file, bytes that
do not change between nodes, a sparse file that serves only what it holds."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from pmetal.pipeline.gguf_file import GGUFFile
from pmetal.pipeline.models import ModelStore, manifest_of
from pmetal.store import (
    HEADER,
    ChecksumError,
    Manifest,
    ModelError,
    ModelFormatError,
    PieceStore,
)


def test_pieces_tile_the_file_and_hash_what_they_cover(tiny_gguf: Path) -> None:
    manifest = manifest_of(tiny_gguf)
    data = tiny_gguf.read_bytes()
    assert manifest.sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.size == len(data) and manifest.filename == "tiny.gguf"
    assert manifest.pieces[0].name == HEADER and manifest.pieces[0].offset == 0
    with GGUFFile(tiny_gguf) as gguf:
        tensors = gguf.tensors
        assert {p.name for p in manifest.pieces[1:]} == set(tensors)
        for piece in manifest.pieces[1:]:
            # A tensor's piece starts at its bytes and holds them all.
            assert piece.offset == tensors[piece.name].offset
            assert piece.length >= tensors[piece.name].nbytes
    at = 0
    for piece in manifest.pieces:
        assert piece.offset == at
        assert hashlib.sha256(data[at:piece.end]).hexdigest() == piece.sha256
        at = piece.end
    assert at == len(data)


def test_a_manifest_is_the_same_bytes_wherever_it_is_built(tiny_gguf: Path,
                                                           tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    one, two = manifest_of(tiny_gguf), manifest_of(copy, filename="tiny.gguf")
    assert one.encode() == two.encode() and one.digest == two.digest
    assert Manifest.decode(one.encode(), sha256=one.sha256, digest=one.digest) == one
    with pytest.raises(ChecksumError, match="not the"):
        Manifest.decode(one.encode(), digest="0" * 64)
    with pytest.raises(ChecksumError, match="not " + "1" * 64):
        manifest_of(tiny_gguf, sha256="1" * 64)


@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(format=2), "format 2"),
    (lambda m: m.update(filename="../x"), "not a plain file name"),
    (lambda m: m.update(filename=".hidden"), "not a plain file name"),
    (lambda m: m["pieces"][1].__setitem__(1, 5), "does not follow"),
    (lambda m: m["pieces"].pop(), "do not tile"),
    (lambda m: m["pieces"][1].__setitem__(3, "XYZ"), "malformed"),
    (lambda m: m.update(size="big"), "size"),
    (lambda m: m.update(pieces=[]), "1 to"),
])
def test_a_malformed_manifest_is_refused(tiny_gguf: Path, change, why: str) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(manifest_of(tiny_gguf).encode())
    change(raw)
    with pytest.raises(ModelFormatError, match=why):
        Manifest.decode(json.dumps(raw).encode())


def test_a_folder_holds_and_serves_only_checked_pieces(tiny_gguf: Path, tmp_path: Path) -> None:
    manifest = manifest_of(tiny_gguf)
    store = PieceStore(tmp_path / "models")
    folder = store.create(manifest)
    assert folder.path.stat().st_size == manifest.size
    assert folder.path.stat().st_blocks * 512 < manifest.size    # sparse: nothing written
    assert folder.held() == bytes(len(manifest.pieces)) and folder.held_bytes() == 0
    piece = manifest.by_name["blk.2.ffn_up.weight"]
    with pytest.raises(ModelError, match="does not hold blk.2.ffn_up.weight"):
        folder.read(piece.offset, 16)
    data = tiny_gguf.read_bytes()
    with folder.writer() as fd:
        os.pwrite(fd, data[piece.offset:piece.end], piece.offset)
        folder.commit(fd, [piece])
    assert folder.read(piece.offset, piece.length) == data[piece.offset:piece.end]
    with pytest.raises(ModelError, match="does not hold"):
        folder.read(piece.offset, piece.length + 1)    # one byte into the next piece
    info = store.list()[0]
    assert (info.held_pieces, info.held_bytes, info.complete) == (1, piece.length, False)
    assert store.remove(manifest.sha256) and store.list() == []


def test_a_path_is_taken_into_the_store_once(tiny_gguf: Path, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    progress = io.StringIO()
    ref = store.reference(str(tiny_gguf), progress=progress)
    assert ref is not None and "stored as model" in progress.getvalue()
    assert ref.path == tmp_path / "models" / ref.sha256 / "tiny.gguf"
    assert ref.path.read_bytes() == tiny_gguf.read_bytes()
    assert ref.key == f"sha256:{ref.sha256}"
    # The second time the store knows the file (a hard link): no hashing.
    again = io.StringIO()
    assert store.reference(str(tiny_gguf), progress=again) == ref and again.getvalue() == ""
    assert store.resolve(ref.sha256) == ref.path
    assert store.sha256_of(ref.sha256[:10]) == ref.sha256
    assert store.remove(ref.sha256[:10]) and not ref.path.exists() and tiny_gguf.exists()


def _hold_piece_lock(folder_root: str, sha256: str, index: int, stop: bool,
                     locked: Any, release: Any) -> None:
    """In a child process: take piece ``index``'s lock, then stop (a holder
    stopped or stuck), or hold it until ``release`` and exit."""
    import signal as _signal
    folder = PieceStore(Path(folder_root)).open(sha256)
    assert folder is not None and folder.try_lock(folder.manifest.pieces[index])
    locked.set()
    if stop:
        os.kill(os.getpid(), _signal.SIGSTOP)
    release.wait(30)
    os._exit(0)   # the lock goes with the process


def test_a_wait_for_a_piece_another_process_holds_ends_when_it_makes_no_progress(
        tiny_gguf: Path, tmp_path: Path) -> None:
    """A piece another process of this machine is writing is waited for
    only while that process makes progress: a holder stopped (SIGSTOP)
    is an error naming the piece after ``stall``, never a hang; a holder
    that lets go is waited for."""
    import multiprocessing
    import signal
    manifest = manifest_of(tiny_gguf)
    folder = PieceStore(tmp_path / "models").create(manifest)
    piece = manifest.by_name["blk.2.ffn_up.weight"]
    ctx = multiprocessing.get_context("spawn")
    for stop in (True, False):
        locked, release = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_hold_piece_lock,
                            args=(str(tmp_path / "models"), manifest.sha256, piece.index, stop,
                                  locked, release))
        child.start()
        try:
            assert locked.wait(60), "the child never took the lock"
            assert not folder.try_lock(piece)
            if stop:
                with pytest.raises(ModelError, match="blk.2.ffn_up.weight.*no progress"):
                    folder.lock(piece, stall=0.3)
            else:
                release.set()
                folder.lock(piece, stall=20.0)   # the child exits: its lock goes
                folder.unlock(piece)
        finally:
            if child.pid is not None:
                os.kill(child.pid, signal.SIGKILL)
            child.join(10)
