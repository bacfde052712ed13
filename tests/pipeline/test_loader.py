"""The loaders read back exactly what the tiny-model writers wrote: every
layer range, both formats, tied and untied heads, q/k un-permuted; and refuse
what the decoder cannot compute with an error that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pmetal.errors import PMetalError
from pmetal.pipeline.gguf_file import GGUFFile
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.loader import (
    load_config,
    load_weights,
    permute_rotary,
    unpermute_rotary,
)
from pmetal.pipeline.models import ModelFormatError, UnknownModelError
from tests.pipeline.tinymodel import (
    llama_cpp_permute,
    tiny_config,
    to_dtype,
    write_tiny_gguf,
    write_tiny_hf,
)

FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
PROMPT = [1, 40, 77, 5, 200, 3, 64, 2]


def assert_same(loaded: LlamaWeights, written: LlamaWeights, dtype: str = "F32") -> None:
    assert loaded.config == written.config
    for offset, layer in enumerate(loaded.layers):
        source = written.layers[loaded.start + offset]
        for field in FIELDS:
            array = getattr(layer, field)
            assert array.dtype == np.float32 and array.flags.c_contiguous, field
            np.testing.assert_array_equal(array, to_dtype(getattr(source, field), dtype),
                                          err_msg=f"layer {loaded.start + offset} {field}")
    for name in ("embed_tokens", "norm", "lm_head"):
        array = getattr(loaded, name)
        if array is not None:
            np.testing.assert_array_equal(array, to_dtype(getattr(written, name), dtype))


def full_logits(weights: LlamaWeights, tokens: list[int]) -> np.ndarray:
    stage = LlamaStage(weights)
    return stage.logits(stage.forward(stage.embed(tokens), stage.new_cache(64)))


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def config(request: pytest.FixtureRequest) -> LlamaConfig:
    return tiny_config(tied=request.param)


def test_permute_helpers_invert_llama_cpp() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8 * 6, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, 8, 8)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(permute_rotary(w, 8), permuted)
    np.testing.assert_array_equal(unpermute_rotary(permuted, 8), w)


@pytest.mark.parametrize("start,end", [(0, 4), (0, 2), (2, 4), (1, 3), (3, 4), (0, 1)])
def test_gguf_layer_ranges_load_what_was_written(tmp_path: Path, config: LlamaConfig,
                                                 start: int, end: int) -> None:
    path = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(path, config, seed=5)
    assert load_config(path) == config
    loaded = load_weights(path, start, end)
    assert (loaded.start, loaded.end) == (start, end)
    assert (loaded.embed_tokens is not None) == (start == 0)
    assert (loaded.lm_head is not None) == (loaded.norm is not None) == (end == 4)
    assert_same(loaded, written)
    if end == 4 and config.tie_word_embeddings:
        np.testing.assert_array_equal(loaded.lm_head, written.embed_tokens)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_folder_loads_what_was_written(tmp_path: Path, config: LlamaConfig, dtype: str,
                                          shards: int) -> None:
    written = write_tiny_hf(tmp_path / "m", config, seed=6, dtype=dtype, shards=shards)
    assert load_config(tmp_path / "m") == config
    assert_same(load_weights(tmp_path / "m"), written, dtype)
    assert_same(load_weights(tmp_path / "m", 1, 3), written, dtype)


def test_both_formats_compute_the_same_logits(tmp_path: Path, config: LlamaConfig) -> None:
    """The decoder follows Hugging Face's rotate-half convention: had the
    GGUF loader kept llama.cpp's q/k row order, these logits would differ."""
    written = write_tiny_gguf(tmp_path / "t.gguf", config, seed=7)
    write_tiny_hf(tmp_path / "hf", config, seed=7)
    expected = full_logits(written, PROMPT)
    np.testing.assert_allclose(full_logits(load_weights(tmp_path / "t.gguf"), PROMPT),
                               expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(full_logits(load_weights(tmp_path / "hf"), PROMPT),
                               expected, rtol=0, atol=1e-5)
    # Stages loaded separately chain to the same logits.
    first = LlamaStage(load_weights(tmp_path / "t.gguf", 0, 2))
    last = LlamaStage(load_weights(tmp_path / "t.gguf", 2, 4))
    hidden = first.forward(first.embed(PROMPT), first.new_cache(64))
    np.testing.assert_allclose(last.logits(last.forward(hidden, last.new_cache(64))),
                               expected, rtol=0, atol=1e-5)


def test_quantized_gguf_is_dequantized(tmp_path: Path) -> None:
    config = tiny_config()
    written = write_tiny_gguf(tmp_path / "q.gguf", config, seed=8, quantize=True)
    loaded = load_weights(tmp_path / "q.gguf")
    for a, b in zip(loaded.layers, written.layers, strict=True):
        for field in ("wq", "wk", "wo", "w_down"):
            # Q8_0: one scale per 32 values, so the error is at most half a step
            # of the block's largest value / 127.
            np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=0,
                                       atol=float(np.abs(getattr(b, field)).max()) / 127)
    assert not np.array_equal(loaded.layers[0].wq, written.layers[0].wq)
    logits = full_logits(loaded, PROMPT)
    np.testing.assert_array_equal(logits.argmax(-1), full_logits(written, PROMPT).argmax(-1))


def test_a_stage_reads_only_its_own_layers(tmp_path: Path) -> None:
    """A file missing layer 3's tensors serves a stage of layers 0-1; a
    stage that needs layer 3 gets an error naming the tensor."""
    path = tmp_path / "holey.gguf"
    write_tiny_gguf(path, tiny_config(), skip=("blk.3.ffn_up.weight",))
    assert load_weights(path, 0, 2).end == 2
    with pytest.raises(ModelFormatError, match=r"blk\.3\.ffn_up\.weight"):
        load_weights(path, 2, 4)


def test_missing_hf_tensor_is_named(tmp_path: Path) -> None:
    write_tiny_hf(tmp_path / "m", tiny_config(tied=False), skip=("lm_head.weight",))
    assert load_weights(tmp_path / "m", 0, 2).end == 2
    with pytest.raises(ModelFormatError, match="lm_head.weight"):
        load_weights(tmp_path / "m", 2, 4)


def test_non_llama_models_are_refused(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "g.gguf", tiny_config(), architecture="gpt2")
    with pytest.raises(ModelFormatError, match="'gpt2' model"):
        load_config(tmp_path / "g.gguf")
    write_tiny_hf(tmp_path / "m", tiny_config(), model_type="gemma2")
    with pytest.raises(ModelFormatError, match=r"model_type='gemma2' architectures=\['X'\]; "
                                               "pmetal's decoder computes"):
        load_weights(tmp_path / "m")


def test_shape_mismatch_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_tiny_hf(folder, tiny_config())
    data = json.loads((folder / "config.json").read_text())
    data["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelFormatError, match=r"mlp\.gate_proj\.weight has shape \(96, 64\)"):
        load_weights(folder)


def test_corrupt_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, tiny_config())
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 1000])
    with pytest.raises(ModelFormatError, match="truncated"):
        load_weights(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:100])
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        load_config(tmp_path / "head.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    with pytest.raises(ModelFormatError, match="neither"):
        load_config(tmp_path / "junk.gguf")
    with pytest.raises(UnknownModelError):
        load_config(tmp_path / "absent.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_config(tmp_path / "empty")
    with pytest.raises(PMetalError, match="non-empty range"):
        load_weights(path, 3, 3)


def test_gguf_metadata_and_tensor_infos(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    config = tiny_config()
    write_tiny_gguf(path, config)
    with GGUFFile(path) as file:
        assert file.metadata["general.architecture"] == "llama"
        assert file.metadata["llama.block_count"] == 4
        assert file.tensors["blk.0.ffn_down.weight"].shape == (64, 96)
        assert file.tensors["token_embd.weight"].shape == (config.vocab_size, 64)
        assert "output.weight" not in file.tensors
