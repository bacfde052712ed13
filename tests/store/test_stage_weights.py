"""Stages load their layers from their own node's store: node daemons on
loopback, each with a home of its own, the model only in the driver's node's
store. A pipeline of 1, 2 and 3 stages generates the single-process greedy
tokens; a stage on another node pulls exactly the pieces its layers need
(the namespace lab, tests/pipeline/test_pipeline_store_lab.py, does the same
across hosts whose filesystems do not see each other)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

import pmetal
from pmetal.config import load_config
from pmetal.model.quantized import QuantizedStage
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.loader import load_config as model_config
from pmetal.pipeline.loader import load_quantized, stage_tensors
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.store import HEADER, ModelUnavailableError
from tests.store.conftest import NAMESPACE, NodeProc

PROMPTS = [[1, 2, 3, 4], [40, 41], [7] * 9]
MAX_TOKENS = 10


def test_stages_on_other_nodes_pull_their_layers_and_answer_as_one(
        tiny_gguf: Path, start_node: Callable[..., NodeProc], psk: bytes,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a = start_node("a")
    b = start_node("b", peers=(a.address,))
    c = start_node("c", peers=(a.address, b.address))
    expected = [r.tokens for r in generate_single_process(
        QuantizedStage(load_quantized(tiny_gguf)), PROMPTS,
        SamplingConfig(max_tokens=MAX_TOKENS), max_len=64)]
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    monkeypatch.setenv("PMETAL_HOME", str(a.home))    # this driver is on node a's machine
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    pmetal.init(address=a.address, psk=psk, namespace=NAMESPACE,
                config=load_config(transport={"request_timeout": 10.0}))
    try:
        pmetal.wait_for_peers(2, timeout=30.0)
        got = {}
        for placement in ([a, b, c], [a, c], [a]):
            with Pipeline.from_pretrained(str(tiny_gguf), stages=len(placement),
                                          placement=[n.node_id for n in placement],
                                          max_len=64, threads=1) as pipe:
                got[len(placement)] = [r.tokens for r in pipe.generate(
                    PROMPTS, max_tokens=MAX_TOKENS, chat=False)]
                if len(placement) == 3:
                    shares = {n: (p.start, p.end) for n, p in zip(placement, pipe.placements)}
                    loaded = pipe.loaded
        assert got == {3: expected, 2: expected, 1: expected}
    finally:
        pmetal.shutdown(timeout=3.0)
    # The 3-stage pipeline: b held nothing and pulled exactly its share.
    assert loaded[0]["pulled"] == 0 and loaded[1]["pulled"] > 0
    assert set(loaded[1]["pulled_from"]) == {a.address}
    config = model_config(tiny_gguf)
    folder = b.store.pieces.open(sha)
    assert folder is not None
    names = stage_tensors(folder.manifest.by_name, config, *shares[b])
    assert {p.name for p, h in zip(folder.manifest.pieces, folder.held()) if h} == \
        {HEADER, *names}
    assert loaded[1]["pulled"] == folder.held_bytes() < folder.manifest.size
    assert not any(p.name.startswith("blk.0.") for p in folder.manifest.named(names))
    assert a.store.pieces.open(sha).info().complete
    assert c.store.pieces.open(sha) is not None


def test_a_stage_with_no_member_holding_the_model_fails_naming_it(
        tiny_gguf: Path, start_node: Callable[..., NodeProc], psk: bytes, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's machine has the model, but its node's store is another
    home (the driver connected to a node elsewhere): the stage on another
    node finds it nowhere, and says which model, where, and what to do."""
    a = start_node("a")
    b = start_node("b", peers=(a.address,))
    monkeypatch.setenv("PMETAL_HOME", str(tmp_path / "driver-home"))
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    pmetal.init(address=a.address, psk=psk, namespace=NAMESPACE,
                config=load_config(transport={"request_timeout": 5.0}))
    try:
        pmetal.wait_for_peers(1, timeout=30.0)
        with pytest.raises(ModelUnavailableError) as info:
            Pipeline.from_pretrained(str(tiny_gguf), stages=1, placement=[b.node_id],
                                     max_len=64, threads=1)
    finally:
        pmetal.shutdown(timeout=3.0)
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    message = str(info.value)
    assert "stage 0" in message and sha[:12] in message and "pmetal models" in message, message


def test_a_driver_names_a_model_its_machine_lacks_by_sha256(
        tiny_gguf: Path, start_node: Callable[..., NodeProc], psk: bytes, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's machine holds nothing of the model; node a does. Named
    by its sha256, the driver takes the header alone from the cluster (the
    shape and the tokenizer) and the stages take their layers themselves."""
    a = start_node("a")
    b = start_node("b", peers=(a.address,))
    ref = a.store.reference(str(tiny_gguf))
    assert ref is not None
    expected = [r.tokens for r in generate_single_process(
        QuantizedStage(load_quantized(tiny_gguf)), PROMPTS,
        SamplingConfig(max_tokens=MAX_TOKENS), max_len=64)]
    driver_home = tmp_path / "driver-home"
    monkeypatch.setenv("PMETAL_HOME", str(driver_home))
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    pmetal.init(address=b.address, psk=psk, namespace=NAMESPACE,
                config=load_config(transport={"request_timeout": 10.0}))
    try:
        pmetal.wait_for_peers(1, timeout=30.0)
        with Pipeline.from_pretrained(ref.sha256, stages=2, placement=[a.node_id, b.node_id],
                                      max_len=64, threads=1) as pipe:
            got = [r.tokens for r in pipe.generate(PROMPTS, max_tokens=MAX_TOKENS,
                                                   chat=False)]
            assert pipe.tokenizer is not None    # read from the header
        # One stage on the driver's own node: the driver's file is partial, so
        # it is never handed over as a path (its holes read as zeros).
        with Pipeline.from_pretrained(ref.sha256, stages=1, placement=[b.node_id],
                                      max_len=64, threads=1) as pipe:
            alone = [r.tokens for r in pipe.generate(PROMPTS, max_tokens=MAX_TOKENS,
                                                     chat=False)]
    finally:
        pmetal.shutdown(timeout=3.0)
    assert got == expected and alone == expected
    from pmetal.store import PieceStore

    mine = PieceStore(driver_home / "models").open(ref.sha256)
    assert mine is not None
    assert [p.name for p, h in zip(mine.manifest.pieces, mine.held()) if h] == [HEADER]
