"""Fuzzing the decoder: whatever arrives, ``decode`` returns an Envelope or
raises ProtocolError, and anything it accepts can be sent back (a Pong echo
re-encodes whatever a Ping carried)."""

from __future__ import annotations

import dataclasses
import random
import typing
from typing import Any

import mlx.core as mx   # the test extra installs it (mlx[cpu] on Linux)
import msgpack
import numpy as np
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from pmetal import wire
from pmetal.errors import ProtocolError
from pmetal.wire import (
    PROTOCOL_VERSION,
    Envelope,
    Kind,
    Pickled,
    WireLimits,
    decode,
    encode,
    frame_bytes,
    message_types,
)

# Building big structures is slow by hypothesis' standards, not by ours.
SLOW_OK = [HealthCheck.too_slow]

# Small limits so that the oversize checks are reachable by small inputs too.
LIMITS = WireLimits(max_message_bytes=4096, max_envelope_bytes=1024, chunk_bytes=64)

DTYPE_NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
               "object", "<i4", ">f8", "V4", "U2", "datetime64[s]", ""]


def check_decode(frames: list[bytes], allow_pickle: bool) -> Envelope | None:
    """The property every test here asserts; any exception but ProtocolError fails."""
    try:
        env = decode(frames, allow_pickle=allow_pickle, limits=LIMITS)
    except ProtocolError:
        event("rejected")
        return None
    event("accepted")
    assert isinstance(env, Envelope)
    assert type(env.body) is message_types()[env.body.KIND]
    assert type(env.corr) is int and env.corr >= 0
    assert env.term is None or type(env.term) is int
    assert env.sender is None or type(env.sender) is str
    echoed = decode(encode(env.body, corr=env.corr, term=env.term, sender=env.sender),
                    allow_pickle=True)
    assert type(echoed.body) is type(env.body)
    assert (echoed.corr, echoed.term, echoed.sender) == (env.corr, env.term, env.sender)
    return env


# ------------------------------------------------------------ random bytes

@settings(max_examples=1500, deadline=None, suppress_health_check=SLOW_OK)
@given(head=st.one_of(st.binary(max_size=256),
                      # a plausible start reaches the checks after msgpack parsing
                      st.binary(max_size=64).map(lambda b: b"\x96\x01" + b),
                      st.binary(max_size=64).map(lambda b: b"\x96\x01\x0a\x00\xc0\xc0" + b)),
       allow_pickle=st.booleans())
def test_random_envelope_bytes(head: bytes, allow_pickle: bool) -> None:
    check_decode([head], allow_pickle)


@settings(max_examples=800, deadline=None, suppress_health_check=SLOW_OK)
@given(frames=st.lists(st.binary(max_size=64), max_size=6), allow_pickle=st.booleans())
def test_random_frame_lists(frames: list[bytes], allow_pickle: bool) -> None:
    check_decode(frames, allow_pickle)


# ------------------------------------------------- mutated valid messages

def _valid_messages() -> list[list[bytes]]:
    chunked = WireLimits(chunk_bytes=64)
    bodies: list[Any] = [
        wire.Ping(None),
        wire.Hello(node_id="n" * 32, public_key=b"k" * 32, ephemeral_key=b"e" * 32,
                   nonce=b"\x00" * 16, namespace_tag=b"t" * 32),
        wire.ErrorReply("ValueError", "bad", "Traceback ..."),
        wire.ActorLocation("actor-1", "alive", methods=("get", "put"), incarnation=3),
        wire.Call("actor-1", "incr", [1, {"by": 2.5}], {"flag": True}),
        wire.Ping({"a": np.arange(40, dtype=np.float32),
                   "b": [np.zeros((0, 3)), np.array(7, np.int8)],
                   "c": np.arange(6, dtype=np.complex64).reshape(2, 3).T}),
        wire.Pong([Pickled(b"\x80\x05N."), {"k": np.ones((2, 2), ">i2")}]),
        wire.Ping([mx.arange(20).astype(mx.bfloat16), mx.array([1.5])]),
    ]
    return [[bytes(frame_bytes(f)) for f in encode(body, corr=5, term=2, sender="s",
                                                       limits=chunked)]
            for body in bodies]


VALID_MESSAGES = _valid_messages()


@st.composite
def mutated_messages(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(f) for f in draw(st.sampled_from(VALID_MESSAGES))]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite", "drop",
                                   "duplicate", "swap", "append"]))
        if not frames:
            frames.append(bytearray(draw(st.binary(max_size=16))))
            continue
        i = draw(st.integers(0, len(frames) - 1))
        frame = frames[i]
        if op == "flip" and frame:
            pos = draw(st.integers(0, len(frame) - 1))
            frame[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del frame[draw(st.integers(0, len(frame))):]
        elif op == "insert":
            pos = draw(st.integers(0, len(frame)))
            frame[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "overwrite" and frame:
            pos = draw(st.integers(0, len(frame) - 1))
            new = draw(st.binary(min_size=1, max_size=4))
            frame[pos:pos + len(new)] = new
        elif op == "drop":
            del frames[i]
        elif op == "duplicate":
            frames.insert(i, bytearray(frame))
        elif op == "swap":
            j = draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "append":
            frames.append(bytearray(draw(st.binary(max_size=32))))
    return [bytes(f) for f in frames]


def test_valid_messages_decode_before_mutation() -> None:
    for frames in VALID_MESSAGES:
        assert decode(frames, allow_pickle=True, limits=LIMITS).corr == 5


@settings(max_examples=1200, deadline=None, suppress_health_check=SLOW_OK)
@given(frames=mutated_messages(), allow_pickle=st.booleans())
def test_mutated_valid_messages(frames: list[bytes], allow_pickle: bool) -> None:
    check_decode(frames, allow_pickle)


# ------------------------------------------ random envelope-like structures
# Hypothesis strategies for nested structures cost ~10 ms an example here, so
# the bulk run draws only a seed and builds the structure with random.Random;
# note() prints the frames of a failing seed. The typed-body test below stays
# with strategies, which shrink a failure to its smallest form.

INTERESTING = [None, True, False, 0, 1, -1, 2**63 - 1, -2**63, 2**64 - 1, 0.5, float("nan"),
               float("inf"), "", "héllo", "int32", b"", b"\x00\xff"]
# Sizes that an array header of a few small dimensions can match exactly.
BUFFER_SIZES = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def random_scalar(rng: random.Random) -> Any:
    roll = rng.randrange(5)
    if roll == 0:
        return rng.randint(-2**63, 2**64 - 1)
    if roll == 1:
        return "".join(rng.choice("aé中\x00") for _ in range(rng.randrange(5)))
    if roll == 2:
        return rng.randbytes(rng.randrange(9))
    return rng.choice(INTERESTING)


def random_extension(rng: random.Random) -> msgpack.ExtType:
    roll = rng.randrange(6)
    if roll == 0:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(13)))
    if roll == 1:  # an array header of any shape at all
        header = [random_value(rng, depth=2) for _ in range(rng.randrange(6))]
    else:
        shape = [rng.randrange(5) for _ in range(rng.randrange(4))]
        dtype = rng.choice(DTYPE_NAMES[:14] if rng.random() < 0.7 else DTYPE_NAMES)
        header = [dtype, shape, rng.randrange(1, 4), rng.randrange(3)]
    return msgpack.ExtType(rng.choice([1, 1, 3, 2]), msgpack.packb(header))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 3 and roll < 0.2:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if depth < 3 and roll < 0.3:
        return {random_scalar(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if roll < 0.4:
        return random_extension(rng)
    return random_scalar(rng)


def random_envelope(rng: random.Random) -> list[Any]:
    """Each field is right four times in five, anything otherwise."""
    def pick(right: Any) -> Any:
        return right if rng.random() < 0.8 else random_value(rng)

    kind = rng.choice(list(Kind))
    nfields = len(dataclasses.fields(message_types()[kind])) + rng.choice([-1, 0, 0, 0, 1])
    envelope = [pick(PROTOCOL_VERSION), pick(int(kind)), pick(rng.randrange(2**64)),
                pick(rng.choice([None, rng.randint(-2**63, 2**63 - 1)])),
                pick(rng.choice([None, "node"])),
                pick([random_value(rng) for _ in range(max(nfields, 0))])]
    if rng.random() < 0.05:
        del envelope[rng.randrange(6):]
    return envelope


@settings(max_examples=1500, deadline=None, suppress_health_check=SLOW_OK)
@given(seed=st.integers(0, 2**64 - 1), allow_pickle=st.booleans())
def test_random_envelope_structures(seed: int, allow_pickle: bool) -> None:
    rng = random.Random(seed)
    buffers = [rng.randbytes(rng.choice(BUFFER_SIZES)) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
    frames = [msgpack.packb(random_envelope(rng)), *buffers]
    note(f"frames={frames!r}")
    check_decode(frames, allow_pickle)


keys = st.one_of(st.sampled_from(INTERESTING), st.text(max_size=3))
scalars = st.one_of(st.sampled_from(INTERESTING), st.integers(-2**63, 2**64 - 1),
                    st.text(max_size=4), st.binary(max_size=8))
array_headers = st.builds(
    lambda code, header: msgpack.ExtType(code, msgpack.packb(header)),
    st.sampled_from([1, 3]),
    st.tuples(st.sampled_from(DTYPE_NAMES), st.lists(st.integers(0, 4), max_size=3),
              st.integers(1, 4), st.integers(0, 2)))
values = st.recursive(
    st.one_of(scalars, array_headers),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=2)),
    max_leaves=4)

# A field of the declared type most of the time, anything otherwise.
_FIELD_VALUES: dict[Any, st.SearchStrategy[Any]] = {
    str: st.text(max_size=8), bytes: st.binary(max_size=8), int: st.integers(-2**63, 2**64 - 1),
    float: st.one_of(st.floats(), st.integers(-5, 5)), bool: st.booleans(),
    list: st.lists(values, max_size=3), dict: st.dictionaries(keys, values, max_size=3),
    dict | None: st.one_of(st.none(), st.dictionaries(keys, values, max_size=3)),
    tuple[str, ...]: st.lists(st.text(max_size=4), max_size=3),
    tuple[int, ...]: st.lists(st.integers(-2**63, 2**64 - 1), max_size=3),
    tuple[list, ...]: st.lists(st.lists(values, max_size=5), max_size=3),
}


def _typed_body(kind: Kind) -> st.SearchStrategy[list[Any]]:
    cls = message_types()[kind]
    hints = typing.get_type_hints(cls)
    fields = [values if hints[f.name] is Any else st.one_of(_FIELD_VALUES[hints[f.name]], values)
              for f in dataclasses.fields(cls)]
    return st.integers(0, len(fields)).flatmap(lambda n: st.tuples(*fields[:n]).map(list))


typed_envelopes = st.sampled_from(sorted(Kind)).flatmap(
    lambda kind: st.tuples(st.just(PROTOCOL_VERSION), st.just(int(kind)),
                           st.integers(0, 2**64 - 1),
                           st.one_of(st.none(), st.integers(-2**63, 2**64 - 1)),
                           st.one_of(st.none(), st.text(max_size=8)), _typed_body(kind)))


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW_OK)
@given(envelope=typed_envelopes.map(list),
       buffers=st.lists(st.sampled_from(BUFFER_SIZES).map(bytes), max_size=3),
       allow_pickle=st.booleans())
def test_envelopes_with_plausible_bodies(envelope: list[Any], buffers: list[bytes],
                                         allow_pickle: bool) -> None:
    check_decode([msgpack.packb(envelope), *buffers], allow_pickle)
