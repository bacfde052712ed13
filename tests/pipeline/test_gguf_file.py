"""A GGUF file from the internet is checked before memory is spent on it:
every crafted size, count, nesting, alignment and metadata value is one
ModelFormatError naming what is wrong, and random damage to a valid file
never raises anything else (docs/security.md, "Model files")."""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pmetal.errors import PMetalValueError
from pmetal.pipeline.gguf_file import MAX_ARRAY_NESTING, GGUFFile
from pmetal.pipeline.loader import gguf_config, load_config
from pmetal.pipeline.models import ModelFormatError
from pmetal.pipeline.tokenizer import Tokenizer
from tests.pipeline.tinymodel import CHAT_TEMPLATE, tiny_config, write_tiny_gguf

# ------------------------------------------------------------ raw writer

U32, I32, F32, STRING, ARRAY, U64 = 4, 5, 6, 8, 9, 10
GGML_F32 = 0


def _value(kind: int, value: Any) -> bytes:
    if kind == STRING:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if isinstance(value, bytes):  # written as it is
        return value
    if kind == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(_value(item, v) for v in items)
    return struct.pack({U32: "<I", I32: "<i", F32: "<f", U64: "<Q"}[kind], value)


def raw_gguf(kvs: list[tuple[str, int, Any]] = (),  # type: ignore[assignment]
             tensors: list[tuple[str, tuple[int, ...], int, int]] = (),  # type: ignore[assignment]
             *, data: bytes = b"", counts: tuple[int, int] | None = None) -> bytes:
    """A GGUF v3 file byte by byte: ``kvs`` as (key, type, value), ``tensors``
    as (name, dims innermost first, ggml type, offset), then ``data`` at the
    next multiple of 32. ``counts`` overrides the (tensor, kv) counts."""
    n_tensors, n_kv = counts if counts is not None else (len(tensors), len(kvs))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
    for key, kind, value in kvs:
        out += _value(STRING, key) + struct.pack("<I", kind) + _value(kind, value)
    for name, dims, kind, offset in tensors:
        out += _value(STRING, name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    return out + b"\0" * (-len(out) % 32) + data


def refused(tmp_path: Path, content: bytes, match: str) -> ModelFormatError:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match=match) as info:
        GGUFFile(path).close()
    return info.value


# ------------------------------------------------------------ tensor sizes

@pytest.mark.parametrize("dims", [(2**32, 2**32), (2**63 + 1,), (2**64 - 1, 2**64 - 1),
                                  (32, 2**62, 4, 8)])
def test_tensor_sizes_beyond_the_file_are_refused_without_wrapping(
        tmp_path: Path, dims: tuple[int, ...]) -> None:
    """np.prod in int64 made (2**32, 2**32) zero bytes and 2**63+1 negative."""
    error = refused(tmp_path, raw_gguf(tensors=[("w", dims, GGML_F32, 0)], data=b"\0" * 64),
                    r"tensor w runs past the end of the file \(truncated download\?\): "
                    rf"shape {re.escape(str(tuple(reversed(dims))))}, \d+ bytes at offset \d+, "
                    r"the file has \d+ bytes")
    assert "truncated" in str(error)


def test_a_zero_dimension_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, raw_gguf(tensors=[("w", (4, 0), GGML_F32, 0)], data=b"\0" * 64),
            r"tensor w has a dimension of 0")


@pytest.mark.parametrize("n_dims", [0, 5, 2**31])
def test_dimension_counts_outside_one_to_four_are_refused(tmp_path: Path, n_dims: int) -> None:
    content = raw_gguf(tensors=[("w", (1,), GGML_F32, 0)], data=b"\0" * 64)
    at = content.index(b"w") + 1
    content = content[:at] + struct.pack("<I", n_dims) + content[at + 4:]
    refused(tmp_path, content, rf"tensor w has {n_dims} dimensions; GGUF tensors have 1 to 4")


def test_unknown_ggml_types_are_named(tmp_path: Path) -> None:
    refused(tmp_path, raw_gguf(tensors=[("blk.0.w", (4,), 4242, 0)], data=b"\0" * 64),
            r"tensor blk\.0\.w has unknown ggml type 4242")


def test_misaligned_and_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    refused(tmp_path, raw_gguf(tensors=[("w", (4,), GGML_F32, 8)], data=b"\0" * 64),
            r"tensor w's offset 8 is not a multiple of general.alignment \(32\)")
    refused(tmp_path, raw_gguf(tensors=[("a", (16,), GGML_F32, 0), ("b", (4,), GGML_F32, 32)],
                               data=b"\0" * 128),
            r"tensors a and b overlap")
    refused(tmp_path, raw_gguf(tensors=[("a", (4,), GGML_F32, 0), ("a", (4,), GGML_F32, 32)],
                               data=b"\0" * 64),
            r"tensor a appears twice")


# ------------------------------------------------------------ counts and strings

@pytest.mark.parametrize("counts", [(2**64 - 1, 0), (0, 2**64 - 1), (2**40, 2**40)])
def test_entry_counts_beyond_the_file_are_refused_before_looping(
        tmp_path: Path, counts: tuple[int, int]) -> None:
    error = refused(tmp_path, raw_gguf(counts=counts), r"header is truncated or corrupt: it claims \d+ key-values and "
                    r"\d+ tensors at offset 24, more than the file's 32 bytes can hold")
    assert "truncated" in str(error)


def test_string_and_array_lengths_beyond_the_file_are_refused(tmp_path: Path) -> None:
    content = raw_gguf([("general.name", STRING, "abc")])
    at = content.index(b"abc") - 8
    huge = content[:at] + struct.pack("<Q", 2**63) + content[at + 8:]
    refused(tmp_path, huge, r"truncated or corrupt: the value of general\.name needs "
                            rf"{2**63} bytes at offset {at + 8}, but the file has \d+ bytes")
    started = time.monotonic()
    for item, least in ((STRING, 8), (ARRAY, 12)):
        strings = raw_gguf([("k", ARRAY, (item, []))])
        at = strings.index(struct.pack("<IQ", item, 0)) + 4
        refused(tmp_path, strings[:at] + struct.pack("<Q", 2**60) + strings[at + 8:],
                rf"k claims {2**60} array elements of at least {least} bytes")
    refused(tmp_path, raw_gguf([("k", ARRAY, (U64, [1, 2]))])[:-40],
            "truncated")
    assert time.monotonic() - started < 1.0  # no loop of 2**60 iterations


def test_deeply_nested_arrays_are_refused_by_key(tmp_path: Path) -> None:
    value: Any = (U32, [1, 2])
    expected: Any = [1, 2]
    for _ in range(MAX_ARRAY_NESTING - 1):
        value, expected = (ARRAY, [value]), [expected]
    path = tmp_path / "ok.gguf"
    path.write_bytes(raw_gguf([("deep.ok", ARRAY, value)]))
    with GGUFFile(path) as file:
        assert file.metadata["deep.ok"] == expected
    # 5000 arrays of one array, far past Python's recursion limit
    evil = struct.pack("<IQ", ARRAY, 1) * 5000 + _value(ARRAY, (U32, [1, 2]))
    refused(tmp_path, raw_gguf([("deep.evil", ARRAY, evil)]),
            rf"deep\.evil nests arrays more than {MAX_ARRAY_NESTING} deep")


def test_unknown_value_types_and_duplicate_keys(tmp_path: Path) -> None:
    refused(tmp_path, raw_gguf([("a", U32, 1), ("a", U32, 2)]), "GGUF key a appears twice")
    content = raw_gguf([("k", U32, 7)])
    at = content.index(b"k") + 1
    refused(tmp_path, content[:at] + struct.pack("<I", 77) + content[at + 4:],
            "k has unknown GGUF value type 77")
    strings = raw_gguf([("k", ARRAY, (U32, []))])
    at = strings.index(struct.pack("<IQ", U32, 0))
    refused(tmp_path, strings[:at] + struct.pack("<I", 99) + strings[at + 4:],
            "k is an array of unknown GGUF value type 99")


@pytest.mark.parametrize("alignment", [(U32, 0), (U32, 48), (I32, -32), (F32, 32.0),
                                       (STRING, "32")])
def test_alignment_must_be_a_positive_power_of_two(tmp_path: Path,
                                                   alignment: tuple[int, Any]) -> None:
    refused(tmp_path, raw_gguf([("general.alignment", *alignment)],
                               [("w", (4,), GGML_F32, 0)], data=b"\0" * 64),
            r"general\.alignment is .*, not a positive power of two")


def test_truncation_names_the_offset_and_the_file_size(tmp_path: Path) -> None:
    content = raw_gguf([("general.name", STRING, "a tiny model")], [("w", (8,), GGML_F32, 0)],
                       data=b"\0" * 32)
    refused(tmp_path, content[:30], r"truncated or corrupt: .* at offset 24, more than the "
                                    r"file's 30 bytes can hold")
    refused(tmp_path, content[:80], r"truncated or corrupt: tensor w's info needs 4 bytes at "
                                    r"offset 77, but the file has 80 bytes")
    refused(tmp_path, content[:-1], r"tensor w runs past the end of the file \(truncated "
                                    rf"download\?\): shape \(8,\), 32 bytes at offset "
                                    rf"{len(content) - 32}, the file has {len(content) - 1} bytes")


# ------------------------------------------------------------ metadata the loader converts

def _metadata() -> dict[str, Any]:
    c = tiny_config()
    return {"general.architecture": "llama", "llama.block_count": c.num_hidden_layers,
            "llama.context_length": c.max_position_embeddings,
            "llama.embedding_length": c.hidden_size,
            "llama.feed_forward_length": c.intermediate_size,
            "llama.attention.head_count": c.num_attention_heads,
            "llama.attention.head_count_kv": c.num_key_value_heads,
            "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": c.vocab_size, "tokenizer.ggml.bos_token_id": 1}


@pytest.mark.parametrize(("key", "value"), [
    ("llama.attention.head_count", 0),               # hidden // heads: ZeroDivisionError
    ("llama.attention.head_count", "9"),
    ("llama.rope.freq_base", float("inf")),          # rotary tables of NaN
    ("llama.rope.freq_base", float("nan")),
    ("llama.rope.freq_base", 1e300),                 # inf as the float32 it is computed in
    ("llama.attention.layer_norm_rms_epsilon", "1e-5"),
    ("llama.context_length", float("inf")),          # int(inf): OverflowError
    ("llama.context_length", float("nan")),          # int(nan): ValueError
    ("llama.context_length", 2**60),                 # a rotary table of 2**60 rows
    ("llama.block_count", 10**6),                    # more layers than tensors
    ("llama.embedding_length", -64),
    ("llama.feed_forward_length", True),
    ("llama.vocab_size", [1, 2]),
    ("llama.attention.key_length", 0),
    ("llama.rope.dimension_count", 2.5),
    ("tokenizer.ggml.bos_token_id", 10**9),
    ("tokenizer.ggml.bos_token_id", "1"),
])
def test_bad_metadata_values_are_named(key: str, value: Any) -> None:
    metadata = {**_metadata(), key: value}
    with pytest.raises(ModelFormatError, match=f"GGUF {re.escape(key)} is "):
        gguf_config(metadata, Path("m.gguf"), {f"t{i}" for i in range(40)})


def test_a_combination_llama_config_refuses_names_the_gguf_keys() -> None:
    metadata = {**_metadata(), "llama.attention.head_count_kv": 3}   # 4 heads, 3 kv heads
    with pytest.raises(ModelFormatError, match=r"llama\.attention\.head_count, "
                                               r"llama\.attention\.head_count_kv\).*multiple"):
        gguf_config(metadata, Path("m.gguf"), {f"t{i}" for i in range(40)})


def test_the_tiny_model_still_loads(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", tiny_config())
    assert load_config(tmp_path / "t.gguf") == tiny_config()


# ------------------------------------------------------------ fuzz

def _small_gguf(path: Path) -> bytes:
    """A valid GGUF of a few hundred bytes with every value kind the parser
    reads (scalars, strings, arrays of numbers, strings and arrays) and
    tensors of three ggml types, written by the gguf package."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**_metadata(), "llama.block_count": 1}.items():  # 1 layer <= 3 tensors
        if key == "general.architecture":
            continue
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_string("general.name", "fuzz")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["a", "b", "ab", "<s>", "é"])
    writer.add_token_types([1, 1, 1, 3, 1])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(3)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_bool("flag", True)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((2, 8), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((3, 4)).astype(np.float16))
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((2, 32), dtype=np.float32),
                                                 q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _small_gguf(tmp_path_factory.mktemp("fuzz") / "small.gguf")


_mutation = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("u64"), st.integers(0, 10**6),
              st.sampled_from([0, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1])),
    st.tuples(st.just("u32"), st.integers(0, 10**6), st.sampled_from([0, 4, 5, 8, 9, 13, 2**32 - 1])),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
)


def _mutate(content: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    data = bytearray(content)
    for kind, where, value in mutations:
        at = where % max(1, len(data))
        if kind == "cut":
            del data[at:]
        elif kind == "byte" and data:
            data[at] = value
        else:
            fmt = "<Q" if kind == "u64" else "<I"
            data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(data)


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_damaged_files_parse_or_raise_model_format_error(
        tmp_path: Path, small_gguf: bytes, mutations: list[tuple[str, int, int]]) -> None:
    """Whatever the damage: a ModelFormatError or a file whose tensors,
    config, tokenizer and chat template read (a template may also refuse the
    messages), within a second of this process's CPU time (not of the wall
    clock, which a loaded machine stretches: 1.09 s at load 10) and 16 MiB
    (numpy's buffers included: tracemalloc sees them)."""
    path = tmp_path / "damaged.gguf"
    path.write_bytes(_mutate(small_gguf, mutations))
    tracemalloc.start()
    started = time.process_time()
    try:
        with GGUFFile(path) as file:
            for name in file.tensors:
                file.tensor(name)
            metadata = file.metadata
        gguf_config(metadata, path, set(file.tensors))
        tokenizer = Tokenizer.from_gguf_metadata(metadata, path)
        tokenizer.encode_prompt("ab é")
    except ModelFormatError:
        pass
    except PMetalValueError as exc:  # a damaged role name: raise_exception()
        assert "refused the messages" in str(exc)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.process_time() - started < 1.0
    assert peak < 16 << 20
