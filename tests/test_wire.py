"""The wire codec: every message kind and array layout survives a round trip,
and malformed frames raise ProtocolError and nothing else."""

from __future__ import annotations

import dataclasses
import math
import pickle
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from pmetal import wire
from pmetal.errors import ProtocolError
from pmetal.wire import (
    PROTOCOL_VERSION,
    Envelope,
    Kind,
    Message,
    Pickled,
    Ping,
    Pong,
    WireLimits,
    decode,
    encode,
    frame_bytes,
    message_types,
)

ADDRESS = "tcp://127.0.0.1:52417"

EXAMPLES: dict[Kind, Message] = {
    Kind.HELLO: wire.Hello(
        node_id="a" * 32, public_key=b"\x01" * 32, ephemeral_key=b"\x02" * 32,
        nonce=b"\x03" * 16, namespace_tag=b"\x04" * 32),
    Kind.WELCOME: wire.Welcome(
        node_id="b" * 32, public_key=b"\x05" * 32, ephemeral_key=b"\x06" * 32,
        nonce=b"\x07" * 16, proof=b"\x08" * 32, signature=b"\x09" * 64),
    Kind.CONFIRM: wire.Confirm(proof=b"\x0a" * 32, signature=b"\x0b" * 64),
    Kind.ACCEPTED: wire.Accepted(node_id="c" * 32),
    Kind.REJECTED: wire.Rejected(reason="namespace tag does not match"),
    Kind.PING: Ping({"ints": [0, -1, 2**63 - 1], "float": 2.5, "text": "héllo",
                     "raw": b"\x00\xff", "none": None, "flag": True,
                     "nested": {"deeper": [[], {}]}}),
    Kind.PONG: Pong([1, "two", b"three"]),
    Kind.ERROR: wire.ErrorReply(
        error_type="ValueError", message="bad input",
        traceback="Traceback (most recent call last): ..."),
    Kind.WORKER_READY: wire.WorkerReady(worker_id="w-1", address=ADDRESS, pid=4242),
    Kind.CREATE_ACTOR: wire.CreateActor(
        actor_id="actor-1", cls_id="cls-1", cls_ref="pkg.mod:Counter", args=[1, "two"],
        kwargs={"start": 3}, options={"num_cpus": 1, "max_restarts": 2, "name": None}),
    Kind.ACTOR_LOCATION: wire.ActorLocation(
        actor_id="actor-1", state="alive", address=ADDRESS, node_id="d" * 32, incarnation=2,
        name="counter", reason="restarted", class_name="Counter", methods=("get", "incr"),
        is_async=True, max_task_retries=-1, owner_lease=7.5),
    Kind.LOOKUP_ACTOR: wire.LookupActor(name="counter", min_incarnation=1, wait=0.5,
                                        local=True),
    Kind.KILL_ACTOR: wire.KillActor(actor_id="actor-1", no_restart=False,
                                    worker_address="tcp://127.0.0.1:5000"),
    Kind.LEASE_WORKERS: wire.LeaseWorkers(count=3, avoid=("tcp://127.0.0.1:5000",)),
    Kind.WORKER_LIST: wire.WorkerList(addresses=(ADDRESS, "tcp://127.0.0.1:52418")),
    Kind.STATUS_REQUEST: wire.StatusRequest(detail=True),
    Kind.STATUS: wire.Status(info={"master": "n1", "nodes": [{"id": "n1", "cpus": 8}]}),
    Kind.ACK: wire.Ack(info={"ok": True}),
    Kind.SHUTDOWN: wire.Shutdown(reason="operator request"),
    Kind.NODE_JOIN: wire.NodeJoin(
        node_id="e" * 32, address=ADDRESS, resources={"CPU": 8, "GPU": 0.5}),
    Kind.OWNER_DIED: wire.OwnerDied("ab" * 16, 4321, "cd" * 16),
    Kind.DETACH: wire.Detach("pmetal.shutdown()"),
    Kind.RESOURCES_REQUEST: wire.ResourcesRequest(),
    Kind.RESOURCES: wire.Resources({"CPU": 2.0}, {"CPU": 1.0}, 1),
    Kind.MACHINE_REQUEST: wire.MachineRequest(),
    Kind.MACHINE: wire.Machine([{"actor_id": "a1", "name": "counter", "state": "alive",
                                 "restarts": 0, "last_error": "", "pid": None}],
                               [{"pipeline": "p", "index": 1, "steps": 3}], 1 << 34, 1 << 33,
                               {"CPU": 1.0}, 0, 2, 80 << 20),
    Kind.CREATE_PLACEMENT_GROUP: wire.CreatePlacementGroup(
        "pg-1", "train", [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}], "STRICT_SPREAD",
        {"lifetime": "", "owner_pid": 12}),
    Kind.RESERVE_BUNDLES: wire.ReserveBundles("pg-1", 2, [[0, {"CPU": 1.0}]], False, "n" * 16),
    Kind.PLACEMENT_GROUP_QUERY: wire.PlacementGroupQuery("pg-1", "", False, True, False),
    Kind.PLACEMENT_GROUPS: wire.PlacementGroups([{"group_id": "pg-1", "state": "CREATED"}]),
    Kind.BEAT: wire.Beat("a" * 32, 7, ADDRESS, 3, "b" * 32, 5, 4, 12.5, ADDRESS),
    Kind.BEAT_ECHO: wire.BeatEcho("a" * 32, 12.5),
    Kind.VOTE_REQUEST: wire.VoteRequest(4, "a" * 32, 5, True),
    Kind.VOTE: wire.Vote(4, "b" * 32, False, True, "a master is alive"),
    Kind.CLUSTER_VIEW: wire.ClusterView(3, "b" * 32, 5, [
        {"node_id": "a" * 32, "address": ADDRESS, "incarnation": 7, "resources": {"CPU": 2.0},
         "profile": {"cores": 2}, "state": "alive"}]),
    Kind.JOIN_CLUSTER: wire.JoinCluster(2, [{"node_id": "a" * 32, "address": ADDRESS}]),
    Kind.WATCH_CLUSTER: wire.WatchCluster(4, 10.0),
    Kind.CLUSTER_STATE: wire.ClusterState(5, ("c" * 32,), "b" * 32, 3, 5,
                                                 ("a" * 32, "b" * 32)),
    Kind.PROBE: wire.Probe(b"x" * 100),
    Kind.INIT_ACTOR: wire.InitActor(
        actor_id="actor-1", cls_id="cls-1", cls_ref=Pickled(pickle.dumps(dict)), args=[],
        kwargs={"a": 1}, options={}, incarnation=1),
    Kind.CALL: wire.Call(actor_id="actor-1", method="incr", args=[1], kwargs={"by": 2}),
    Kind.CANCEL_CALL: wire.CancelCall(corr=7),
    Kind.STREAM_CALL: wire.StreamCall("a1", "items", None, [1, "x"], {"k": 2}, (8, 9, 10)),
    Kind.STREAM_CREDIT: wire.StreamCredit(stream=7, corrs=(11, 12)),
    Kind.STREAM_STOP: wire.StreamStop(stream=7, cancel=True),
    Kind.CALL_BATCH: wire.CallBatch(actor_id="actor-1",
                                    calls=[["incr", [1], {}], ["incr", [], {"by": 2}]],
                                    corrs=(7, 8)),
    Kind.RUN_TASK: wire.RunTask(fn_id="fn-1", fn_ref=None, args=[[1, 2]], kwargs={}),
    Kind.RESULT: wire.Result(value={"total": 3}),
    Kind.MODEL_QUERY: wire.ModelQuery(sha256="ab" * 32),
    # (the store sends uint8 arrays, out of band; any value decodes)
    Kind.MODEL_HOLDINGS: wire.ModelHoldings(manifest=b'{"format":1}', held=b"\x01\x00"),
    Kind.PIECE_READ: wire.PieceRead(sha256="ab" * 32, offset=4096, length=1 << 20),
    Kind.PIECE_DATA: wire.PieceData(data=b"GGUF"),
    Kind.FETCH_OBJECT: wire.FetchObject(oid=12, wait=2.5),
    Kind.BORROW_UPDATES: wire.BorrowUpdates(borrowers=("e" * 32, "f" * 32), oids=(1, 2, 2),
                                            who=(0, 0, 1), deltas=(1, -3, 1)),
    Kind.TELEMETRY_REQUEST: wire.TelemetryRequest(),
    Kind.TELEMETRY: wire.Telemetry(
        pid=4321, role="worker", calls=200, failed=3, latency=(150, 40, 10, 0, 0, 0, 0, 0, 0),
        latency_sum=0.07, owned=2, borrowed=1, collectives=(["g", "ring", 4, 4096, 0.01],),
        pipelines=(["smollm", 2, 32, 33, 0.5, 9000, 8000, 0.01],),
        stages=(["smollm", 0, 33, 0.2, 7000, 0.02],)),
    Kind.FAILURE: wire.Failure(
        kind="user", error_type="ValueError", message="bad", traceback="Traceback ...",
        exception=Pickled(pickle.dumps(ValueError("bad")))),
}

ROUTINGS = [
    {},
    {"corr": 7, "term": 3, "sender": "node-a"},
    {"corr": 2**64 - 1, "term": 0, "sender": ""},
    {"corr": 1, "term": -5, "sender": None},
]

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]

SHAPES = [(), (7,), (2, 3, 4), (0,), (3, 0, 2)]

SMALL_CHUNK = WireLimits(chunk_bytes=1024)


def transmit(frames: list[Any]) -> list[bytes]:
    """What the receiving socket hands over: fresh immutable byte strings."""
    return [bytes(frame_bytes(f)) for f in frames]


DEFAULT_LIMITS = WireLimits()


def round_trip(body: Message, limits: WireLimits = DEFAULT_LIMITS, **routing: Any) -> Envelope:
    return decode(transmit(encode(body, limits=limits, **routing)), limits=limits)


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct, non-trivial values of ``dtype`` (negatives where the type has them)."""
    n = math.prod(shape)
    base = np.arange(n, dtype=np.int64) * 37 - n
    if dtype == "bool":
        values = base % 3 == 0
    elif dtype.startswith("complex"):
        values = base + 0.5j * base[::-1]
    elif dtype.startswith("float"):
        values = base / 4
    else:
        values = base
    return values.astype(dtype).reshape(shape)


def assert_same_array(got: Any, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------- messages

def test_every_registered_kind_has_an_example() -> None:
    """Registering a new message kind fails here until EXAMPLES covers it."""
    types = message_types()
    assert set(EXAMPLES) == set(types)
    for kind, body in EXAMPLES.items():
        assert type(body) is types[kind]
        assert body.KIND is kind


def test_every_kind_has_a_message_class() -> None:
    assert set(message_types()) == set(Kind)


@pytest.mark.parametrize("routing", ROUTINGS, ids=["none", "all", "extremes", "negative-term"])
@pytest.mark.parametrize("kind", sorted(EXAMPLES), ids=lambda k: k.name)
def test_every_kind_round_trips_with_routing_fields(kind: Kind, routing: dict[str, Any]) -> None:
    body = EXAMPLES[kind]
    frames = encode(body, **routing)
    assert len(frames) == 1
    assert decode(transmit(frames), allow_pickle=True) == Envelope(body, **routing)


def fields_of(kind: Kind) -> list[dataclasses.Field]:
    return dataclasses.fields(message_types()[kind])


def body_of(kind: Kind) -> list[Any]:
    (head,) = encode(EXAMPLES[kind])
    return msgpack.unpackb(head)[5]


def required_fields(kind: Kind) -> int:
    return sum(1 for f in fields_of(kind)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


@pytest.mark.parametrize("kind", sorted(EXAMPLES), ids=lambda k: k.name)
def test_every_kind_rejects_a_wrong_number_of_fields(kind: Kind) -> None:
    body = body_of(kind)
    with pytest.raises(ProtocolError, match="fields"):
        decode([envelope(kind=int(kind), body=[*body, None])], allow_pickle=True)
    required = required_fields(kind)
    if required:
        with pytest.raises(ProtocolError, match="fields"):
            decode([envelope(kind=int(kind), body=body[:required - 1])], allow_pickle=True)
    defaults = decode([envelope(kind=int(kind), body=body[:required])], allow_pickle=True).body
    for f in fields_of(kind)[required:]:
        assert getattr(defaults, f.name) == f.default


@pytest.mark.parametrize("kind", sorted(EXAMPLES), ids=lambda k: k.name)
def test_every_kind_rejects_wrongly_typed_fields(kind: Kind) -> None:
    hints = typing.get_type_hints(message_types()[kind])
    body = body_of(kind)
    for i, f in enumerate(fields_of(kind)):
        if hints[f.name] is Any:
            continue
        wrong = 5 if hints[f.name] is str else "five"
        bad = [*body[:i], wrong, *body[i + 1:]]
        with pytest.raises(ProtocolError, match=message_types()[kind].__name__):
            decode([envelope(kind=int(kind), body=bad)], allow_pickle=True)


def test_envelope_layout_matches_the_module_docstring() -> None:
    (head,) = encode(wire.Accepted("n"), corr=5, term=2, sender="s")
    assert msgpack.unpackb(head) == [PROTOCOL_VERSION, int(Kind.ACCEPTED), 5, 2, "s", ["n"]]


def test_omitted_trailing_fields_take_their_defaults() -> None:
    head = msgpack.packb([PROTOCOL_VERSION, int(Kind.ERROR), 0, None, None, ["KeyError", "k"]])
    assert decode([head]).body == wire.ErrorReply("KeyError", "k", "")
    empty_ping = msgpack.packb([PROTOCOL_VERSION, int(Kind.PING), 0, None, None, []])
    assert decode([empty_ping]).body == Ping()


def test_decoded_fields_are_normalised_to_their_declared_types() -> None:
    lookup = decode([envelope(kind=int(Kind.LOOKUP_ACTOR), body=["a", "", 0, 2])]).body
    assert lookup.wait == 2.0 and type(lookup.wait) is float
    workers = decode([envelope(kind=int(Kind.WORKER_LIST), body=[[ADDRESS]])]).body
    assert workers.addresses == (ADDRESS,)


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        EXAMPLES[Kind.ACCEPTED].node_id = "other"  # type: ignore[misc]


def test_numpy_scalars_travel_as_plain_values() -> None:
    body = Ping([np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(200)])
    payload = round_trip(body).body.payload
    assert payload == [1.5, -3, True, 200]
    assert [type(v) for v in payload] == [float, int, bool, int]


def test_tuples_arrive_as_lists() -> None:
    assert round_trip(Ping((1, (2, 3)))).body.payload == [1, [2, 3]]


def test_decode_accepts_zmq_frames_and_memoryviews() -> None:
    arr = sample("float32", (4, 4))
    frames = encode(Ping(arr), corr=9)
    for received in ([zmq.Frame(bytes(frame_bytes(f))) for f in frames],
                     [memoryview(bytes(frame_bytes(f))) for f in frames]):
        env = decode(received)
        assert env.corr == 9
        assert_same_array(env.body.payload, arr)


def test_frame_bytes_gives_a_flat_byte_view() -> None:
    view = frame_bytes(np.arange(6, dtype=np.float32).reshape(2, 3).data)
    assert (view.format, view.ndim, view.nbytes) == ("B", 1, 24)
    assert frame_bytes(b"abc").tobytes() == b"abc"
    assert frame_bytes(zmq.Frame(b"xyz")).tobytes() == b"xyz"


# ----------------------------------------------------------------- arrays

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_array_round_trips(dtype: str, shape: tuple[int, ...]) -> None:
    arr = sample(dtype, shape)
    frames = encode(Ping(arr))
    assert len(frames) == (1 if arr.size == 0 else 2)  # zero-size arrays have no frames
    assert_same_array(decode(transmit(frames)).body.payload, arr)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_single_frame_array_is_decoded_zero_copy_and_read_only(dtype: str) -> None:
    arr = sample(dtype, (3, 5))
    received = transmit(encode(Ping(arr)))
    got = decode(received).body.payload
    assert_same_array(got, arr)
    assert np.shares_memory(got, np.frombuffer(received[1], np.uint8))
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0] = got[1, 1]


def test_contiguous_array_is_encoded_zero_copy() -> None:
    arr = sample("int32", (10, 10))
    frames = encode(Ping(arr))
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), arr)


NON_CONTIGUOUS = {
    "step-slice": lambda: sample("int64", (20,))[::3],
    "negative-step": lambda: sample("float32", (4, 6))[:, ::-2],
    "transpose": lambda: sample("complex64", (3, 4, 5)).transpose(2, 0, 1),
    "fortran": lambda: np.asfortranarray(sample("uint16", (5, 7))),
    "column": lambda: sample("float64", (6, 4))[:, 1],
    "broadcast": lambda: np.broadcast_to(sample("int8", (3,)), (4, 3)),
}


@pytest.mark.parametrize("make", NON_CONTIGUOUS.values(), ids=NON_CONTIGUOUS.keys())
def test_non_contiguous_array_arrives_in_c_order(make: Any) -> None:
    arr = make()
    assert not arr.flags.c_contiguous
    got = round_trip(Ping(arr)).body.payload
    assert_same_array(got, arr)
    assert got.flags.c_contiguous


@pytest.mark.parametrize("dtype", [">i2", ">i4", ">u8", ">f4", ">f8", ">c8", ">c16", ">f2"])
def test_big_endian_array_arrives_native(dtype: str) -> None:
    arr = sample(np.dtype(dtype).newbyteorder("=").name, (2, 5)).astype(dtype)
    got = round_trip(Ping(arr)).body.payload
    assert got.dtype.isnative
    assert_same_array(got, arr)


def test_big_endian_multi_frame_array_round_trips() -> None:
    arr = sample("float64", (40, 10)).astype(">f8")
    frames = encode(Ping(arr), limits=SMALL_CHUNK)
    assert len(frames) > 2
    assert_same_array(decode(transmit(frames)).body.payload, arr)


def test_arrays_nested_in_dicts_and_lists() -> None:
    a, b, c = sample("float32", (2, 2)), sample("int16", (3,)), sample("bool", (0,))
    got = round_trip(Ping({"weights": [a, {"bias": b}], "meta": (c, "tag", 3)})).body.payload
    assert set(got) == {"weights", "meta"}
    assert_same_array(got["weights"][0], a)
    assert_same_array(got["weights"][1]["bias"], b)
    assert_same_array(got["meta"][0], c)
    assert got["meta"][1:] == ["tag", 3]


def test_several_arrays_of_mixed_sizes_keep_their_frames_apart() -> None:
    arrays = [sample("float64", (300,)),     # 2400 bytes: 3 frames of <= 1024
              sample("int8", (0, 4)),        # no frame
              sample("uint32", (5,)),        # 1 frame
              sample("complex128", (100,)),  # 1600 bytes: 2 frames
              sample("bool", ())]            # 1 frame
    frames = encode(Pong(arrays), limits=SMALL_CHUNK)
    assert len(frames) == 1 + 3 + 0 + 1 + 2 + 1
    got = decode(transmit(frames), limits=SMALL_CHUNK).body.payload
    assert len(got) == len(arrays)
    for g, a in zip(got, arrays):
        assert_same_array(g, a)


@pytest.mark.parametrize("dtype", ["uint8", "float32", "complex128"])
@pytest.mark.parametrize("chunk", [1000, 1024])
def test_array_larger_than_a_chunk_is_split_and_reassembled(dtype: str, chunk: int) -> None:
    """1000 bytes does not divide a complex128's 16 bytes, so elements straddle frames."""
    limits = WireLimits(chunk_bytes=chunk)
    arr = sample(dtype, (9, 7, 31))
    frames = encode(Ping(arr), limits=limits)
    buffers = frames[1:]
    assert len(buffers) == -(-arr.nbytes // chunk)
    assert all(len(frame_bytes(f)) <= chunk for f in buffers)
    got = decode(transmit(frames), limits=limits).body.payload
    assert_same_array(got, arr)
    assert got.flags.owndata and got.flags.writeable


@pytest.mark.parametrize("extra, frames", [(0, 1), (1, 2)])
def test_chunk_boundary(extra: int, frames: int) -> None:
    arr = np.arange(1024 + extra, dtype=np.uint8)
    encoded = encode(Ping(arr), limits=SMALL_CHUNK)
    assert len(encoded) == 1 + frames
    assert_same_array(decode(transmit(encoded)).body.payload, arr)


def test_disallowed_dtype_cannot_be_sent() -> None:
    for arr in (np.array([object()]), np.array(["text"]), np.zeros(2, "datetime64[s]"),
                np.zeros(2, [("a", "i4"), ("b", "f8")])):
        with pytest.raises(TypeError, match="dtype"):
            encode(Ping(arr))


# -------------------------------------------------------------------- MLX

def _mlx() -> Any:
    import mlx.core   # the test extra installs it (mlx[cpu] on Linux)
    return mlx.core


@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16", "float16", "bool_", "float64"])
def test_mlx_array_round_trips_as_mlx(dtype: str) -> None:
    mx = _mlx()
    arr = mx.array(sample("int32", (4, 6)) % 7).astype(getattr(mx, dtype))
    got = round_trip(Ping(arr)).body.payload
    assert isinstance(got, mx.array)
    assert got.dtype == arr.dtype
    assert got.shape == arr.shape
    assert mx.array_equal(got, arr).item()


def test_mlx_arrays_split_across_frames_and_mixed_with_numpy() -> None:
    mx = _mlx()
    big = mx.arange(2000).astype(mx.bfloat16).reshape(40, 50).T
    small = mx.array([1.5, -2.0])
    host = sample("int64", (3,))
    frames = encode(Ping({"big": big, "small": small, "host": host}), limits=SMALL_CHUNK)
    assert len(frames) > 4
    got = decode(transmit(frames)).body.payload
    assert mx.array_equal(got["big"], big).item() and got["big"].dtype == mx.bfloat16
    assert mx.array_equal(got["small"], small).item()
    assert_same_array(got["host"], host)


def test_mlx_zero_size_and_scalar_arrays() -> None:
    mx = _mlx()
    for arr in (mx.zeros((3, 0, 2)), mx.array(7, dtype=mx.int32)):
        got = round_trip(Ping(arr)).body.payload
        assert got.shape == arr.shape and got.dtype == arr.dtype
        assert mx.array_equal(got, arr).item()


# ---------------------------------------------------------------- pickled

def _closure() -> Any:
    offset = 40
    return lambda x: x + offset


@pytest.mark.parametrize("with_buffers", [False, True], ids=["envelope-only", "with-buffers"])
def test_pickled_closure_round_trips_when_allowed(with_buffers: bool) -> None:
    payload: list[Any] = [Pickled.dumps(_closure())]
    if with_buffers:
        payload.append(sample("float32", (3,)))
    env = decode(transmit(encode(Ping(payload))), allow_pickle=True)
    got = env.body.payload[0]
    assert isinstance(got, Pickled)
    assert got == payload[0]
    assert got.load()(2) == 42


def test_pickled_payload_stays_bytes_until_loaded() -> None:
    """Routing a payload never runs it: garbage decodes, and fails only on load."""
    env = decode(encode(Ping(Pickled(b"not a pickle"))), allow_pickle=True)
    assert env.body.payload == Pickled(b"not a pickle")
    with pytest.raises(pickle.UnpicklingError):
        env.body.payload.load()


def test_pickled_values_round_trip() -> None:
    value = {"set": {1, 2}, "complex": 1 + 2j, "fn": len}
    got = decode(encode(Ping(Pickled.dumps(value))), allow_pickle=True).body.payload
    assert got.load() == value


@pytest.mark.parametrize("with_buffers", [False, True], ids=["envelope-only", "with-buffers"])
def test_pickled_payload_is_refused_unless_allowed(with_buffers: bool) -> None:
    payload: list[Any] = [Pickled.dumps(_closure())]
    if with_buffers:
        payload.append(sample("float32", (3,)))
    with pytest.raises(ProtocolError, match="pickled"):
        decode(transmit(encode(Ping(payload))))


class Opaque:
    pass


@pytest.mark.parametrize("value, name", [(Opaque(), "Opaque"), ({1, 2}, "set"),
                                          (1 + 2j, "complex"), (lambda: 0, "function")])
def test_unmsgpackable_value_is_a_type_error_naming_the_type(value: Any, name: str) -> None:
    with pytest.raises(TypeError, match=rf"cannot send a {name}\b.*Pickled"):
        encode(Ping({"nested": [value]}))


def test_only_registered_messages_can_be_encoded() -> None:
    with pytest.raises(TypeError, match="not a registered message"):
        encode(Opaque())  # type: ignore[arg-type]


def test_encode_refuses_an_oversize_envelope() -> None:
    with pytest.raises(ProtocolError, match="envelope"):
        encode(Ping(b"x" * 200), limits=WireLimits(max_envelope_bytes=100))


# -------------------------------------------------------------- malformed

def envelope(version: Any = PROTOCOL_VERSION, kind: Any = int(Kind.PING), corr: Any = 0,
             term: Any = None, sender: Any = None, body: Any = (None,)) -> bytes:
    """A hand-built envelope; the defaults give a valid Ping."""
    return msgpack.packb([version, kind, corr, term, sender, body], use_bin_type=True)


def array_ext(dtype: Any = "int32", shape: Any = (3,), first: Any = 1, count: Any = 1,
              code: int = 1) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb([dtype, shape, first, count]))


def ping_with(*payload: Any) -> bytes:
    return envelope(body=[list(payload)])


def raw_body(packed: bytes) -> bytes:
    """An envelope whose body is hand-packed msgpack (for what packb will not build)."""
    return envelope(body=[])[:-1] + packed


VALID = encode(EXAMPLES[Kind.HELLO], corr=3, term=1, sender="n")[0]
TWELVE = b"\x00" * 12


def test_hand_built_envelopes_are_valid_baselines() -> None:
    """The malformed cases below each change one thing from these."""
    assert decode([envelope()]) == Envelope(Ping(None))
    got = decode([ping_with(array_ext()), TWELVE]).body.payload[0]
    assert_same_array(got, np.zeros(3, np.int32))


MALFORMED: dict[str, list[bytes]] = {
    "no frames": [],
    "empty envelope": [b""],
    "garbage": [b"\xc1\xff\x00garbage"],
    "trailing bytes": [VALID + b"\x00"],
    "nil envelope": [msgpack.packb(None)],
    "map envelope": [msgpack.packb({"version": 1})],
    "5-element envelope": [msgpack.packb([1, 10, 0, None, None])],
    "7-element envelope": [msgpack.packb([1, 10, 0, None, None, [], 0])],
    # version
    "version 0": [envelope(version=0)],
    "version 2": [envelope(version=PROTOCOL_VERSION + 1)],
    "version str": [envelope(version="1")],
    "version float": [envelope(version=1.0)],
    "version bool": [envelope(version=True)],
    "version nil": [envelope(version=None)],
    "version empty array": [envelope(version=array_ext(shape=[0], count=0))],
    "version array": [envelope(version=array_ext(shape=[3])), TWELVE],
    # kind
    "kind 0": [envelope(kind=0)],
    "kind 99": [envelope(kind=99)],
    "kind -1": [envelope(kind=-1)],
    "kind str": [envelope(kind="PING")],
    "kind float": [envelope(kind=10.0)],
    "kind bool": [envelope(kind=True)],
    "kind nil": [envelope(kind=None)],
    # routing fields
    "negative corr": [envelope(corr=-1)],
    "float corr": [envelope(corr=1.5)],
    "str corr": [envelope(corr="3")],
    "nil corr": [envelope(corr=None)],
    "bool corr": [envelope(corr=True)],
    "str term": [envelope(term="3")],
    "float term": [envelope(term=1.0)],
    "list term": [envelope(term=[1])],
    "bytes sender": [envelope(sender=b"node")],
    "int sender": [envelope(sender=5)],
    "invalid utf-8 sender": [envelope(sender="abc").replace(b"\xa3abc", b"\xa3\xff\xfe\xfd")],
    # body
    "map body": [envelope(body={"payload": 1})],
    "str body": [envelope(body="x")],
    "nil body": [envelope(body=None)],
    "too few fields": [envelope(kind=int(Kind.HELLO), body=["n", b"k", b"e", b"n"])],
    "too few fields with default": [envelope(kind=int(Kind.ERROR), body=["KeyError"])],
    "too many fields": [envelope(body=[1, 2])],
    "too many fields for one": [envelope(kind=int(Kind.ACCEPTED), body=["a", "b"])],
    "int where str": [envelope(kind=int(Kind.ACCEPTED), body=[5])],
    "bytes where str": [envelope(kind=int(Kind.REJECTED), body=[b"reason"])],
    "str where bytes": [envelope(kind=int(Kind.CONFIRM), body=["proof", b"sig"])],
    "nil where str": [envelope(kind=int(Kind.ERROR), body=["E", None])],
    "array where bytes": [envelope(kind=int(Kind.CONFIRM), body=[array_ext(), b"s"]), TWELVE],
    "bool where int": [envelope(kind=int(Kind.WORKER_READY), body=["w", ADDRESS, True])],
    "float where int": [envelope(kind=int(Kind.WORKER_READY), body=["w", ADDRESS, 1.0])],
    "bool where float": [envelope(kind=int(Kind.LOOKUP_ACTOR), body=["", "", 0, True])],
    "int where bool": [envelope(kind=int(Kind.STATUS_REQUEST), body=[1])],
    "int in a tuple of str": [envelope(kind=int(Kind.WORKER_LIST), body=[[ADDRESS, 5]])],
    "map where list": [envelope(kind=int(Kind.CALL), body=["a", "m", {}, {}])],
    "list where map": [envelope(kind=int(Kind.CALL), body=["a", "m", [], []])],
    # frames
    "orphan buffer frame": [envelope(), b"extra"],
    "orphan after array": [ping_with(array_ext()), TWELVE, b"extra"],
    "missing frame": [ping_with(array_ext())],
    "frame beyond the end": [ping_with(array_ext(first=2)), TWELVE],
    "frame 0 is the envelope": [ping_with(array_ext(first=0)), TWELVE],
    "negative first frame": [ping_with(array_ext(first=-3)), TWELVE],
    "frame used twice": [ping_with(array_ext(), array_ext()), TWELVE],
    "frame too short": [ping_with(array_ext()), TWELVE[:-1]],
    "frame too long": [ping_with(array_ext()), TWELVE + b"\x00"],
    "frames too short in total": [ping_with(array_ext(count=2)), b"\x00" * 6, b"\x00" * 5],
    "zero-size with a frame": [ping_with(array_ext(shape=[0], count=1)), b"\x00"],
    "sized without frames": [ping_with(array_ext(count=0))],
    # array headers
    "object dtype": [ping_with(array_ext(dtype="object", shape=[1], count=1)), b"\x00" * 8],
    "explicit-endian dtype": [ping_with(array_ext(dtype="<i4")), TWELVE],
    "void dtype": [ping_with(array_ext(dtype="V4")), TWELVE],
    "datetime dtype": [ping_with(array_ext(dtype="datetime64[s]", count=1)), b"\x00" * 24],
    "bfloat16 as numpy": [ping_with(array_ext(dtype="bfloat16")), b"\x00" * 6],
    "unknown mlx dtype": [ping_with(array_ext(dtype="object", code=3)), TWELVE],
    "int dtype": [ping_with(array_ext(dtype=5)), TWELVE],
    "list dtype": [ping_with(array_ext(dtype=["int32"])), TWELVE],
    "negative dimension": [ping_with(array_ext(shape=[-3])), TWELVE],
    "float dimension": [ping_with(array_ext(shape=[3.0])), TWELVE],
    "shape not a list": [ping_with(array_ext(shape=3)), TWELVE],
    "too many dimensions": [ping_with(array_ext(shape=[1] * 33)), b"\x00" * 4],
    "negative count": [ping_with(array_ext(count=-1)), TWELVE],
    "str first": [ping_with(array_ext(first="1")), TWELVE],
    "huge shape": [ping_with(array_ext(dtype="int8", shape=[2**63, 2], count=0))],
    "wrapping shape": [ping_with(array_ext(dtype="int64", shape=[2**61 + 1, 8])), b"\x00" * 64],
    "3-element header": [ping_with(msgpack.ExtType(1, msgpack.packb(["int32", [3], 1]))), TWELVE],
    "garbage header": [ping_with(msgpack.ExtType(1, b"\xc1")), TWELVE],
    "empty header": [ping_with(msgpack.ExtType(1, b""))],
    # extension types
    "ext 0": [ping_with(msgpack.ExtType(0, b"x"))],
    "ext 4": [ping_with(msgpack.ExtType(4, b"x"))],
    "ext 127": [ping_with(msgpack.ExtType(127, b""))],
    "ext -2": [raw_body(b"\x91\xd4\xfe\x00")],
    "bad timestamp": [raw_body(b"\x91\xc7\x03\xffxyz")],
    # structure
    "deeply nested lists": [raw_body(b"\x91" + b"\x91" * 100_000 + b"\xc0")],
    "deeply nested maps": [raw_body(b"\x91" + b"\x81\xc0" * 100_000 + b"\xc0")],
    "unhashable map key": [raw_body(b"\x91\x81\x91\x01\x02")],
    "array as map key": [raw_body(b"\x91\x81" + msgpack.packb(array_ext(shape=[0], count=0))
                                  + b"\x01")],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
@pytest.mark.parametrize("allow_pickle", [False, True], ids=["no-pickle", "pickle"])
def test_malformed_message_raises_protocol_error(frames: list[bytes], allow_pickle: bool) -> None:
    with pytest.raises(ProtocolError):
        decode(frames, allow_pickle=allow_pickle)


def test_every_truncation_of_a_valid_envelope_raises_protocol_error() -> None:
    for end in range(len(VALID)):
        with pytest.raises(ProtocolError):
            decode([VALID[:end]])


def test_oversize_envelope_is_refused_before_decoding() -> None:
    limits = WireLimits(max_envelope_bytes=len(VALID) - 1)
    with pytest.raises(ProtocolError, match="envelope.*exceeds"):
        decode([VALID], limits=limits)
    assert decode([VALID], limits=WireLimits(max_envelope_bytes=len(VALID))).corr == 3


def test_oversize_message_is_refused() -> None:
    frames = transmit(encode(Ping(np.zeros(100, np.uint8))))
    total = sum(len(f) for f in frames)
    with pytest.raises(ProtocolError, match="message.*exceeds"):
        decode(frames, limits=WireLimits(max_message_bytes=total - 1))
    assert decode(frames, limits=WireLimits(max_message_bytes=total)).body.payload.size == 100


def test_error_message_explains_a_version_mismatch() -> None:
    with pytest.raises(ProtocolError, match="version 2 is not supported.*upgrade"):
        decode([envelope(version=2)])


def test_wrong_field_type_names_the_message() -> None:
    with pytest.raises(ProtocolError, match="Accepted: expected str, got int"):
        decode([envelope(kind=int(Kind.ACCEPTED), body=[5])])
