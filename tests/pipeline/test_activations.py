"""The activation codec and message: error bounds per codec, the frames,
refusal of malformed frames, zero copy, bfloat16 rounding."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings

from pmetal.errors import PMetalValueError, ProtocolError
from pmetal.pipeline.activations import (
    FRAME_FORMAT,
    ActivationCodec,
    ActivationMessage,
    DtypeTag,
)

HIDDEN = 576   # the default model, SmolLM2-135M


def hidden_state(rows: int, seed: int = 0) -> np.ndarray:
    """Activations like a residual stream: mostly O(1), a few large outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    x[:, rng.integers(0, HIDDEN, 4)] *= 40
    return x


def transport(msg: ActivationMessage) -> ActivationMessage:
    """Through frames as a socket delivers them: fresh bytes objects."""
    return ActivationMessage.from_frames([bytes(f) for f in msg.to_frames()])


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("codec", list(ActivationCodec))
def test_round_trip_within_the_documented_bound(codec: ActivationCodec, rows: int) -> None:
    x = hidden_state(rows, seed=rows)
    msg = transport(codec.encode(x, sequence_id=9, position=17, prefill=rows > 1))
    assert (msg.sequence_id, msg.position, msg.shape, msg.prefill) == (9, 17, (rows, HIDDEN),
                                                                     rows > 1)
    assert msg.dtype is codec.tag
    y = ActivationCodec.decode(msg)
    assert y.dtype == np.float32 and y.shape == x.shape
    err = np.abs(y - x)
    if codec is ActivationCodec.NONE:
        assert np.array_equal(y, x)
    elif codec is ActivationCodec.FP16:
        assert (err <= 1e-3 * np.abs(x) + 2.0**-25).all()
        assert err.max() > 0   # it did round
    elif codec is ActivationCodec.BF16:
        assert (err <= 8e-3 * np.abs(x)).all()
        assert (err <= 2.0**-8 * np.abs(x)).all()   # the tighter documented bound
    else:
        peak = np.abs(x).max(axis=1, keepdims=True)
        assert (err <= peak / 127).all()
        assert (err <= peak / 254 * (1 + 1e-5)).all()   # half a step: rounded, not truncated


def test_decode_does_not_need_the_senders_codec() -> None:
    x = hidden_state(3)
    for codec in ActivationCodec:
        msg = codec.encode(x)
        for other in ActivationCodec:
            assert np.array_equal(other.decode(msg), codec.decode(msg))


def test_int8_rounds_to_nearest_and_keeps_zero_rows() -> None:
    x = np.array([[127.0, 0.6, -0.6, 0.4, -127.0], [0, 0, 0, 0, 0]], dtype=np.float32)
    msg = ActivationCodec.INT8.encode(x)
    assert msg.data.tolist() == [[127, 1, -1, 0, -127], [0, 0, 0, 0, 0]]
    assert msg.scales is not None and msg.scales.tolist() == [1.0, 0.0]
    assert np.array_equal(ActivationCodec.decode(transport(msg))[1], np.zeros(5, np.float32))


def test_fp16_saturates_instead_of_overflowing() -> None:
    x = np.array([[1e6, -1e6, 1.0]], dtype=np.float32)
    y = ActivationCodec.decode(ActivationCodec.FP16.encode(x))
    assert y.tolist() == [[65504.0, -65504.0, 1.0]]


def test_int8_refuses_a_diverged_hidden_state() -> None:
    x = hidden_state(2)
    x[1, 3] = np.nan
    with pytest.raises(PMetalValueError, match="NaN, infinity"):
        ActivationCodec.INT8.encode(x)
    with pytest.raises(PMetalValueError, match="diverged"):
        ActivationCodec.INT8.encode(np.array([[1e31, 0.0]], np.float32))


@pytest.mark.parametrize(("codec", "per_token"), [(ActivationCodec.NONE, 2304),
                                                  (ActivationCodec.FP16, 1152),
                                                  (ActivationCodec.BF16, 1152),
                                                  (ActivationCodec.INT8, 580)])
def test_bytes_per_token_for_the_default_model(codec: ActivationCodec, per_token: int) -> None:
    assert codec.bytes_per_row(HIDDEN) == per_token
    msg = codec.encode(hidden_state(5))
    assert msg.nbytes == 5 * per_token
    frames = msg.to_frames()
    assert sum(len(memoryview(f).cast("B")) for f in frames[1:]) == 5 * per_token
    assert len(frames[0]) < 32   # the header is small


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round each finite float32 to the nearer of the two bfloat16 values
    around it, computed in float64 (exact here); ties go to the even one."""
    u = x.view(np.uint32).astype(np.int64)
    low = u >> 16                     # truncation toward zero
    high = low + 1                    # the next bfloat16 away from zero

    def as_f64(bf16_bits: np.ndarray) -> np.ndarray:
        return (bf16_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    v = x.astype(np.float64)
    d_low, d_high = np.abs(v - as_f64(low)), np.abs(as_f64(high) - v)
    up = (d_high < d_low) | ((d_high == d_low) & (low % 2 == 1))
    return np.where(up, high, low).astype(np.uint16)


def test_bf16_rounding_matches_a_float64_reference() -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < 3.0e38)]   # no rounding up into infinity
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00018000,
                     0x3F807FFF, 0x3F808001, 0x00000001, 0x80000000, 0x7F7F0000],
                    dtype=np.uint32).view(np.float32)
    x = np.concatenate([x, ties, hidden_state(4).ravel()]).astype(np.float32)
    got = ActivationCodec.BF16.encode(x.reshape(1, -1)).data.ravel()
    want = bf16_reference(x)
    assert np.array_equal(got, want), f"first mismatch at {np.flatnonzero(got != want)[:5]}"
    # half-way cases go to the even neighbour, both ways
    assert got[-len(ties) - HIDDEN * 4:][:4].tolist() == [0x3F80, 0x3F82, 0xBF80, 0xBF82]


def test_bf16_keeps_nan_and_infinity() -> None:
    x = np.array([[np.inf, -np.inf, 1.0]], dtype=np.float32)
    nan = np.array([0x7F800001, 0xFFFFFFFF, 0x7FC00000], dtype=np.uint32).view(np.float32)
    y = ActivationCodec.decode(ActivationCodec.BF16.encode(np.concatenate([x[0], nan])[None]))
    assert y[0, :3].tolist() == [np.inf, -np.inf, 1.0]
    assert np.isnan(y[0, 3:]).all()


def test_none_is_zero_copy_both_ways() -> None:
    x = hidden_state(8)
    msg = ActivationCodec.NONE.encode(x)
    frames = msg.to_frames()
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), x)
    received = [bytes(f) for f in frames]
    y = ActivationCodec.decode(ActivationMessage.from_frames(received))
    assert np.shares_memory(y, np.frombuffer(received[1], np.uint8))
    assert not y.flags.writeable   # a view of an immutable frame
    assert np.array_equal(y, x)


def test_compressed_payloads_are_views_of_the_frames_too() -> None:
    received = [bytes(f) for f in ActivationCodec.INT8.encode(hidden_state(2)).to_frames()]
    msg = ActivationMessage.from_frames(received)
    assert np.shares_memory(msg.data, np.frombuffer(received[1], np.uint8))
    assert msg.scales is not None
    assert np.shares_memory(msg.scales, np.frombuffer(received[2], np.uint8))


def test_mlx_input_is_accepted() -> None:
    mx = pytest.importorskip("mlx.core")
    x = hidden_state(2)
    for codec in ActivationCodec:
        from_mlx = codec.decode(codec.encode(mx.array(x)))
        assert np.array_equal(from_mlx, codec.decode(codec.encode(x)))
    y = ActivationCodec.decode(ActivationCodec.BF16.encode(mx.array(x).astype(mx.bfloat16)))
    assert np.array_equal(y, ActivationCodec.decode(ActivationCodec.BF16.encode(x)))


def test_bad_input_is_refused() -> None:
    with pytest.raises(PMetalValueError, match=r"\[rows, hidden\]"):
        ActivationCodec.NONE.encode(np.zeros(5, np.float32))
    with pytest.raises(PMetalValueError, match=r"\[rows, hidden\]"):
        ActivationCodec.NONE.encode(np.zeros((0, 5), np.float32))
    with pytest.raises(TypeError, match="floating point"):
        ActivationCodec.NONE.encode(np.zeros((1, 5), np.int32))
    with pytest.raises(TypeError, match="numpy or MLX"):
        ActivationCodec.NONE.encode([[1.0]])
    with pytest.raises(ValueError, match="choose one of"):
        ActivationCodec.parse("fp8")
    assert ActivationCodec.parse("BF16") is ActivationCodec.BF16
    with pytest.raises(PMetalValueError, match="inconsistent"):
        ActivationMessage(0, 0, (1, 4), DtypeTag.INT8, np.zeros((1, 4), np.int8))
    with pytest.raises(PMetalValueError, match="2..63"):
        ActivationCodec.NONE.encode(np.zeros((1, 4), np.float32), sequence_id=1 << 64)
    with pytest.raises(PMetalValueError, match="bool"):
        ActivationCodec.NONE.encode(np.zeros((1, 4), np.float32),
                                    prefill=1)  # type: ignore[arg-type]


def frames_with_header(header: list, data: bytes, *extra: bytes) -> list[bytes]:
    return [msgpack.packb(header), data, *extra]


MALFORMED = {
    "one frame": [msgpack.packb([FRAME_FORMAT, 0, 0, 1, 4, 1, False])],
    "truncated data": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 1, False], bytes(31)),
    "data too long": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 1, False], bytes(33)),
    "unknown tag": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 9, False], bytes(32)),
    "tag zero": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 0, False], bytes(32)),
    "wrong format": frames_with_header([FRAME_FORMAT + 1, 0, 0, 2, 4, 1, False], bytes(32)),
    "huge shape": frames_with_header([FRAME_FORMAT, 0, 0, 1 << 30, 1 << 30, 1, False], b""),
    "zero rows": frames_with_header([FRAME_FORMAT, 0, 0, 0, 4, 1, False], b""),
    "negative position": frames_with_header([FRAME_FORMAT, 0, -1, 1, 4, 1, False], bytes(16)),
    "bool as a dimension": frames_with_header([FRAME_FORMAT, 0, 0, True, 4, 1, False],
                                              bytes(16)),
    "float rows": frames_with_header([FRAME_FORMAT, 0, 0, 1.0, 4, 1, False], bytes(16)),
    "int prefill": frames_with_header([FRAME_FORMAT, 0, 0, 1, 4, 1, 1], bytes(16)),
    "short header": frames_with_header([FRAME_FORMAT, 0, 0, 1, 4, 1], bytes(16)),
    "header not an array": frames_with_header({"rows": 1}, bytes(16)),  # type: ignore[arg-type]
    "garbage header": [b"\xc1\xff\x00", bytes(16)],
    "long header": [msgpack.packb([FRAME_FORMAT, 0, 0, 1, 4, 1, False]) + bytes(200),
                    bytes(16)],
    "int8 without scales": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 4, False], bytes(8)),
    "float32 with scales": frames_with_header([FRAME_FORMAT, 0, 0, 1, 4, 1, False], bytes(16),
                                              bytes(4)),
    "truncated scales": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 4, False], bytes(8),
                                           bytes(7)),
    "NaN scale": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 4, False], bytes(8),
                                    np.array([1.0, np.nan], np.float32).tobytes()),
    "infinite scale": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 4, False], bytes(8),
                                         np.array([np.inf, 1.0], np.float32).tobytes()),
    "negative scale": frames_with_header([FRAME_FORMAT, 0, 0, 2, 4, 4, False], bytes(8),
                                         np.array([-1.0, 1.0], np.float32).tobytes()),
    "not a buffer": [msgpack.packb([FRAME_FORMAT, 0, 0, 1, 4, 1, False]), 12345],
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_frames_raise_protocol_error(case: str) -> None:
    with pytest.raises(ProtocolError, match="activation message"):
        ActivationMessage.from_frames(MALFORMED[case])


def test_the_size_limit_is_enforced_before_reading() -> None:
    frames = ActivationCodec.NONE.encode(hidden_state(4)).to_frames()
    with pytest.raises(ProtocolError, match="more than the limit"):
        ActivationMessage.from_frames(frames, max_bytes=4 * HIDDEN * 4 - 1)
    assert ActivationMessage.from_frames(frames, max_bytes=4 * HIDDEN * 4).shape == (4, HIDDEN)


def test_random_garbage_never_raises_anything_but_protocol_error() -> None:
    rng = np.random.default_rng(3)
    good = ActivationCodec.INT8.encode(hidden_state(2)).to_frames()
    for _ in range(500):
        frames = [bytes(f) for f in good]
        i = int(rng.integers(0, 3))
        raw = bytearray(frames[i])
        if raw and rng.random() < 0.5:
            raw[int(rng.integers(0, len(raw)))] ^= 1 << int(rng.integers(0, 8))
        else:
            raw = raw[: int(rng.integers(0, len(raw) + 1))]
        frames[i] = bytes(raw)
        try:
            msg = ActivationMessage.from_frames(frames)
        except ProtocolError:
            continue
        y = ActivationCodec.decode(msg)   # whatever passed decodes to the right shape
        assert y.shape == msg.shape and y.dtype == np.float32


FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def hidden_states(draw: st.DrawFn, elements: st.SearchStrategy[float] = FINITE) -> np.ndarray:
    shape = draw(st.tuples(st.integers(1, 6), st.integers(1, 40)))
    return draw(hnp.arrays(np.float32, shape, elements=elements))


@settings(max_examples=300, deadline=None)
@given(x=hidden_states(), seq=st.integers(0, (1 << 63) - 1), pos=st.integers(0, 1 << 40),
       prefill=st.booleans())
def test_property_every_codec_meets_its_bound_on_any_finite_input(
        x: np.ndarray, seq: int, pos: int, prefill: bool) -> None:
    for codec in ActivationCodec:
        if codec is ActivationCodec.INT8 and np.abs(x).max() > 2.0**100:
            with pytest.raises(PMetalValueError, match="diverged"):
                codec.encode(x)
            continue
        msg = transport(codec.encode(x, sequence_id=seq, position=pos, prefill=prefill))
        assert (msg.sequence_id, msg.position, msg.prefill) == (seq, pos, prefill)
        y = ActivationCodec.decode(msg).astype(np.float64)
        v = x.astype(np.float64)
        err = np.abs(y - v)
        if codec is ActivationCodec.NONE:
            assert np.array_equal(y, v)
        elif codec is ActivationCodec.FP16:
            inside = np.abs(v) <= 65504
            assert (err[inside] <= 2.0**-11 * np.abs(v[inside]) + 2.0**-25).all()
            assert (y[~inside] == np.sign(v[~inside]) * 65504).all()
        elif codec is ActivationCodec.BF16:
            inside = np.abs(v) < 3.3895e38
            assert (err[inside] <= 2.0**-8 * np.abs(v[inside]) + 2.0**-134).all()
            assert np.isinf(y[~inside]).all() or not (~inside).any()
        else:
            peak = np.abs(v).max(axis=1, keepdims=True)
            bound = np.where(peak < 2.0**-100, peak, peak / 254 * (1 + 1e-5))
            assert (err <= bound).all()
