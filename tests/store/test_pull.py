"""Pieces of a model between real node daemons on loopback, each with a
store of its own: a process pulls exactly the pieces it names, checks each
on arrival, refuses a tampered one, resumes from another member when the one
it was reading from is SIGKILLed mid-transfer, and fails naming the model,
the member and what to do when no member is left. A process without the PSK
gets nothing."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from pmetal.security import NetworkNamespace
from pmetal.store import ChecksumError, ModelUnavailableError, PieceStore
from pmetal.store.pull import Puller, PullProgress
from tests.store.conftest import NAMESPACE, NodeProc


def layer_names(manifest, *layers: int) -> list[str]:  # type: ignore[no-untyped-def]
    return [p.name for p in manifest.pieces
            if any(p.name.startswith(f"blk.{i}.") for i in layers)]


def test_a_process_pulls_exactly_the_pieces_it_names(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    holder, empty = start_node("holder"), start_node("empty")
    ref = holder.store.reference(str(tiny_gguf))
    assert ref is not None
    store = PieceStore(tmp_path / "mine")
    seen: list[PullProgress] = []
    with Puller(store, [empty.address, holder.address], namespace=namespace, config=config,
                progress=seen.append) as puller:
        manifest = puller.manifest(ref.sha256, ref.digest)
        names = layer_names(manifest, 2, 3)
        result = puller.pull(ref.sha256, names, digest=ref.digest)
    folder = result.folder
    wanted = manifest.named(names)
    assert {p.index for p in wanted} == {i for i, h in enumerate(folder.held()) if h}
    assert folder.held_bytes() == sum(p.length for p in wanted) == result.pulled
    assert result.sources == {holder.address: result.pulled}   # the empty node holds nothing
    assert holder.served(namespace)["bytes_served"] == result.pulled
    assert empty.served(namespace)["refused"] == 1               # its "not_found"
    data = tiny_gguf.read_bytes()
    on_disk = folder.path.read_bytes()
    for piece in manifest.pieces:
        expected = data[piece.offset:piece.end] if piece in wanted else bytes(piece.length)
        assert on_disk[piece.offset:piece.end] == expected, piece.name
    assert seen[-1].done == seen[-1].total == result.pulled
    # The loaders read the partial file: the header and layers 2-3 are there.
    from pmetal.pipeline.loader import load_quantized, load_weights
    from pmetal.pipeline.loader import load_weights as reference_weights
    mine = load_weights(folder.path, 2, 4)
    theirs = reference_weights(tiny_gguf, 2, 4)
    assert all((a.wq == b.wq).all() and (a.w_down == b.w_down).all()
               for a, b in zip(mine.layers, theirs.layers))
    load_quantized(folder.path, 2, 4)
    # The rest, then: the whole file, checked whole.
    with Puller(store, [holder.address], namespace=namespace, config=config) as puller:
        whole = puller.pull(ref.sha256)
    assert whole.folder.info().complete and whole.folder.path.read_bytes() == data
    assert whole.pulled == len(data) - result.pulled


def test_a_tampered_piece_is_refused_and_never_stored(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    holder = start_node("holder")
    ref = holder.store.reference(str(tiny_gguf))
    assert ref is not None
    manifest = holder.store.pieces.open(ref.sha256).manifest
    victim = manifest.by_name["blk.1.attn_v.weight"]
    # A byte flipped on the holder's disk (rot, or a member gone bad).
    fd = os.open(ref.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, victim.offset + 7)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), victim.offset + 7)
    finally:
        os.close(fd)
    store = PieceStore(tmp_path / "mine")
    with Puller(store, [holder.address], namespace=namespace, config=config) as puller, \
            pytest.raises(ChecksumError) as info:
        puller.pull(ref.sha256, layer_names(manifest, 1), digest=ref.digest)
    message = str(info.value)
    assert "blk.1.attn_v.weight" in message and holder.address in message
    assert "tampered or corrupt piece" in message and ref.sha256[:12] in message
    folder = store.open(ref.sha256)
    assert folder is not None and not folder.held()[victim.index]
    assert folder.path.read_bytes()[victim.offset:victim.end] == bytes(victim.length)


def test_a_stranger_without_the_psk_gets_nothing(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    holder = start_node("holder")
    ref = holder.store.reference(str(tiny_gguf))
    assert ref is not None
    stranger = NetworkNamespace(NAMESPACE, secrets.token_bytes(32))
    store = PieceStore(tmp_path / "stranger")
    with Puller(store, [holder.address], namespace=stranger, config=config) as puller, \
            pytest.raises(ModelUnavailableError) as info:
        puller.pull(ref.sha256)
    assert holder.address in str(info.value) and "did not answer" in str(info.value)
    assert store.list() == [] and not (tmp_path / "stranger").exists()
    # The node never saw a request of the stranger's, let alone served a byte.
    assert holder.served(namespace) == {"queries": 0, "reads": 0, "bytes_served": 0,
                                        "refused": 0}


def test_a_member_killed_mid_transfer_hands_over_to_another(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    first, second = start_node("first"), start_node("second")
    for node in (first, second):
        node.store.reference(str(tiny_gguf))
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    notes: list[str] = []

    def progress(p: PullProgress) -> None:
        if p.note:
            notes.append(p.note)
        elif p.source == first.address and first.proc.poll() is None:
            first.kill()    # SIGKILL after the first piece it sent

    store = PieceStore(tmp_path / "mine")
    with Puller(store, [first.address, second.address], namespace=namespace, config=config,
                progress=progress) as puller:
        result = puller.pull(sha)
    assert result.folder.path.read_bytes() == tiny_gguf.read_bytes()
    assert result.folder.info().complete
    assert result.sources[first.address] > 0 and result.sources[second.address] > 0
    assert any(first.address in n and "resuming" in n for n in notes), notes


def test_no_member_left_fails_naming_the_model_the_member_and_what_to_do(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    only = start_node("only")
    ref = only.store.reference(str(tiny_gguf))
    assert ref is not None

    def progress(p: PullProgress) -> None:
        if only.proc.poll() is None:
            only.kill()

    store = PieceStore(tmp_path / "mine")
    with Puller(store, [only.address], namespace=namespace, config=config,
                progress=progress) as puller, pytest.raises(ModelUnavailableError) as info:
        puller.pull(ref.sha256)
    message = str(info.value)
    assert ref.sha256[:12] in message and only.address in message
    assert "pmetal models pull" in message and "failed mid-transfer" in message
    folder = store.open(ref.sha256)
    assert folder is not None and not folder.info().complete
    held = folder.held()
    data, on_disk = tiny_gguf.read_bytes(), folder.path.read_bytes()
    for piece in folder.manifest.pieces:   # what is held is right; the rest is zeros
        want = data[piece.offset:piece.end] if held[piece.index] else bytes(piece.length)
        assert on_disk[piece.offset:piece.end] == want


def test_a_node_answers_only_for_what_it_holds(
        tiny_gguf: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    from pmetal.channel import Channel
    from pmetal.identity import NodeIdentity
    from pmetal.transport import ZmqTransport
    from pmetal.wire import Failure, ModelHoldings, ModelQuery, PieceData, PieceRead

    holder = start_node("holder")
    ref = holder.store.reference(str(tiny_gguf))
    assert ref is not None
    transport = ZmqTransport(config.transport, curve=namespace.curve_keys())
    channel = Channel(transport.dial(holder.address), NodeIdentity.generate(), namespace, config)
    try:
        unknown = channel.request(ModelQuery("cd" * 32)).body
        assert isinstance(unknown, Failure) and unknown.kind == "not_found"
        holdings = channel.request(ModelQuery(ref.sha256)).body
        assert isinstance(holdings, ModelHoldings) and set(holdings.held) == {1}
        data = channel.request(PieceRead(ref.sha256, 0, 4)).body
        assert isinstance(data, PieceData) and bytes(data.data) == b"GGUF"
        for offset, length, why in ((0, 64 << 20, "1 to"), (-1, 4, "outside"),
                                    (len(tiny_gguf.read_bytes()) - 2, 4, "outside")):
            refused = channel.request(PieceRead(ref.sha256, offset, length)).body
            assert isinstance(refused, Failure) and why in refused.message, refused
        bad = channel.request(ModelQuery("../../etc")).body
        assert isinstance(bad, Failure) and "not a sha256" in bad.message
    finally:
        channel.close()


SHARE = r"""
import json, sys
from pmetal.config import load_config
from pmetal.security import NetworkNamespace
from pmetal.store import PieceStore
from pmetal.store.pull import Puller
root, sha, address, psk, names = sys.argv[1:6]
ns = NetworkNamespace("store-test", bytes.fromhex(psk))
sys.stdin.readline()                       # start together
with Puller(PieceStore(root), [address], namespace=ns,
            config=load_config(transport={"request_timeout": 10.0})) as puller:
    result = puller.pull(sha, names.split(","))
print(json.dumps({"pulled": result.pulled, "pieces": result.pieces}))
"""


def test_processes_of_one_machine_share_a_folder_without_pulling_twice(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        psk: bytes) -> None:
    """Stages of one machine start together and want overlapping pieces
    (both want the header; here, the same layers): each piece is pulled
    once, by whichever process locked it, and both see it whole."""
    import json
    import subprocess
    import sys

    holder = start_node("holder")
    ref = holder.store.reference(str(tiny_gguf))
    assert ref is not None
    manifest = holder.store.pieces.open(ref.sha256).manifest
    names = layer_names(manifest, 0, 1, 2, 3, 4)
    root = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", SHARE, str(root), ref.sha256,
                               holder.address, psk.hex(), ",".join(names)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for _ in range(3)]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    wanted = manifest.named(names)
    assert sum(r["pieces"] for r in results) == len(wanted)
    assert sum(r["pulled"] for r in results) == sum(p.length for p in wanted)
    folder = PieceStore(root).open(ref.sha256)
    assert folder is not None and folder.holds(wanted)
    data, on_disk = tiny_gguf.read_bytes(), folder.path.read_bytes()
    assert all(on_disk[p.offset:p.end] == data[p.offset:p.end] for p in wanted)


def test_a_member_sending_crafted_answers_is_dropped_not_trusted(
        tiny_gguf: Path, tmp_path: Path, start_node: Callable[[str], NodeProc],
        namespace: NetworkNamespace, config) -> None:  # type: ignore[no-untyped-def]
    """A member gone bad (it holds the PSK): a manifest that is a huge
    integer, then bytes that are an integer: nothing is allocated for them,
    nothing is stored from it, and the pull takes the model from a good
    member."""
    import numpy as np

    from pmetal.endpoint import Incoming, SecureListener, Server
    from pmetal.identity import NodeIdentity
    from pmetal.pipeline.models import manifest_of
    from pmetal.transport import ZmqTransport
    from pmetal.wire import Message, ModelHoldings, ModelQuery, PieceData

    manifest = manifest_of(tiny_gguf)
    asked: list[str] = []

    def liar(incoming: Incoming) -> Message:
        asked.append(type(incoming.body).__name__)
        if isinstance(incoming.body, ModelQuery):
            if asked.count("ModelQuery") == 1:
                return ModelHoldings(10**15, b"\x01" * len(manifest.pieces))
            return ModelHoldings(np.frombuffer(manifest.encode(), np.uint8),
                                 b"\x01" * len(manifest.pieces))
        return PieceData(10**15)

    listener = SecureListener(ZmqTransport(config.transport, curve=namespace.curve_keys())
                              .listen("tcp://127.0.0.1:0"), NodeIdentity.generate(),
                              namespace, config)
    good = start_node("good")
    good.store.reference(str(tiny_gguf))
    with Server(listener, liar):
        store = PieceStore(tmp_path / "mine")
        with Puller(store, [listener.address], namespace=namespace, config=config) as puller, \
                pytest.raises(ModelUnavailableError, match="holds nothing"):
            puller.pull(manifest.sha256)
        with Puller(store, [listener.address, good.address], namespace=namespace,
                    config=config) as puller:
            result = puller.pull(manifest.sha256, layer_names(manifest, 1),
                                 digest=manifest.digest)
    assert "PieceRead" in asked
    assert set(result.sources) == {good.address}       # the liar's bytes were never counted
    assert result.folder.holds(manifest.named(layer_names(manifest, 1)))
