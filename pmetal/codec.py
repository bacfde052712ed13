"""The codec of the pmetal wire protocol: messages to frames and back.

The frame layout, the extension codes for arrays, pickles and shared memory,
and what counts as malformed are documented in :mod:`pmetal.wire`, beside the
messages themselves. This module implements them: field checks per message
class, :func:`encode` (envelope plus zero-copy array buffers) and
:func:`decode` (which raises :class:`~pmetal.errors.ProtocolError` for
anything malformed, and nothing else).

Large arrays for a peer on this host go out of band: the codec writes and
reads only their headers (extension codes 4 and 5) and hands the bytes to an
:class:`OutOfBandWriter` / :class:`OutOfBandReader` that the channel layer
passes in (``pmetal.shm`` provides both). The codec imports nothing of
shared memory.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import sys
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from pmetal.errors import ProtocolError
from pmetal.wire import (_CHECKERS, _REGISTRY, _UNCHECKED, PROTOCOL_VERSION, Message,
                         Pickled)

__all__ = ["Envelope", "OutOfBandReader", "OutOfBandWriter", "WireLimits", "decode", "encode",
           "frame_bytes"]

_EXT_NUMPY = 1
_EXT_PICKLE = 2
_EXT_MLX = 3
_EXT_SHM = 4
_EXT_SLOT = 5

# dtypes that may cross the wire; anything else (object, void, ...) is refused.
_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})
_MLX_DTYPES = _DTYPES | {"bfloat16"}



# ------------------------------------------------------------ field checks

def _checker(tp: Any) -> Callable[[Any], Any]:
    """A function that validates (and normalises) one decoded field."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda v: v
    if tp in (bool, int):   # exactly: a bool is not an int on the wire, nor the reverse
        def check_exact(v: Any, _tp: type = tp) -> Any:
            if type(v) is not _tp:
                raise TypeError(f"expected {_tp.__name__}, got {type(v).__name__}")
            return v
        return check_exact
    if tp is float:
        def check_float(v: Any) -> float:
            if type(v) not in (float, int):
                raise TypeError(f"expected float, got {type(v).__name__}")
            return float(v)
        return check_float
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        # Travels as its string; decoded into the member, and a string
        # outside the enum is refused like a field of the wrong type.
        def check_enum(v: Any, _tp: type[enum.StrEnum] = tp) -> Any:
            if not isinstance(v, str):
                raise TypeError(f"expected {_tp.__name__} (a string), got {type(v).__name__}")
            try:
                return _tp(v)
            except ValueError:
                raise TypeError(f"{v!r} is not a {_tp.__name__} (one of "
                                f"{', '.join(m.value for m in _tp)})") from None
        return check_enum
    if tp in (str, bytes, Pickled):
        def check_type(v: Any, _tp: type = tp) -> Any:
            if not isinstance(v, _tp):
                raise TypeError(f"expected {_tp.__name__}, got {type(v).__name__}")
            return v
        return check_type
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(tp)
        inner = [_checker(a) for a in args if a is not type(None)]
        allow_none = type(None) in args

        def check_union(v: Any) -> Any:
            if v is None and allow_none:
                return None
            for c in inner:
                try:
                    return c(v)
                except TypeError:
                    continue
            raise TypeError(f"{type(v).__name__} does not match {tp}")
        return check_union
    if origin is tuple:
        args = typing.get_args(tp)
        item = _checker(args[0]) if args else (lambda v: v)

        def check_tuple(v: Any) -> tuple:
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"expected sequence, got {type(v).__name__}")
            return tuple(item(x) for x in v)
        return check_tuple
    if origin is dict or tp is dict:
        def check_dict(v: Any) -> dict:
            if not isinstance(v, dict):
                raise TypeError(f"expected map, got {type(v).__name__}")
            return v
        return check_dict
    if origin is list or tp is list:
        def check_list(v: Any) -> list:
            if not isinstance(v, list):
                raise TypeError(f"expected list, got {type(v).__name__}")
            return v
        return check_list
    raise RuntimeError(f"no wire checker for field type {tp!r}")


_GETTERS: dict[type[Message], Callable[[Message], list[Any]]] = {}


def _getter(cls: type[Message]) -> Callable[[Message], list[Any]]:
    """A fast function from a message to its field values in order."""
    found = _GETTERS.get(cls)
    if found is None:
        names = [name for name, _ in _checkers(cls)[1]]
        if len(names) == 1:
            name = names[0]
            found = lambda m: [getattr(m, name)]  # noqa: E731
        elif names:
            get = operator.attrgetter(*names)
            found = lambda m: list(get(m))  # noqa: E731
        else:
            found = lambda m: []  # noqa: E731
        _GETTERS[cls] = found
    return found


def _checkers(cls: type[Message]) -> tuple[int, tuple[tuple[str, Callable[[Any], Any] | None], ...]]:
    found = _CHECKERS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        fields = dataclasses.fields(cls)
        required = sum(1 for f in fields if f.default is dataclasses.MISSING
                       and f.default_factory is dataclasses.MISSING)
        found = (required, tuple((f.name, None if hints[f.name] is Any else _checker(hints[f.name]))
                                 for f in fields))
        _CHECKERS[cls] = found
        if all(check is None for _, check in found[1]):
            _UNCHECKED.add(cls)
    return found


# --------------------------------------------------------------- envelope

class Envelope(typing.NamedTuple):
    """A decoded message with its routing fields."""

    body: Message
    corr: int = 0
    term: int | None = None
    sender: str | None = None


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Size limits applied when decoding (from ``TransportConfig``)."""

    max_message_bytes: int = 2048 << 20
    max_envelope_bytes: int = 64 << 20
    chunk_bytes: int = 1 << 20
    shm_min_bytes: int = 0
    """Encode arrays at least this large through shared memory (0: never).
    Set only for a peer on the same host (Session.local)."""


_DEFAULT_LIMITS = WireLimits()
_tuple_new = tuple.__new__   # builds an Envelope without its Python-level __new__


def frame_bytes(frame: Any) -> memoryview:
    """A byte view of a received frame (bytes, memoryview or ``zmq.Frame``)."""
    buf = getattr(frame, "buffer", None)
    view = buf if buf is not None else memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _mlx() -> Any:
    mx = sys.modules.get("mlx.core")
    return mx


# ------------------------------------------------------------ out of band

class OutOfBandWriter(typing.Protocol):
    """Where the encoder puts arrays of at least ``WireLimits.shm_min_bytes``
    instead of the message's frames (shared memory, for a peer on this
    host: ``pmetal.shm.Exports``). The codec knows only this hook."""

    def put(self, data: memoryview, corr: int) -> tuple[str, int, bool]:
        """Store ``data`` (bytes) for the message with correlation id
        ``corr``; return ``(name, size, reusable)``. Reusable: a slot of
        ``size >= len(data)`` bytes that the sender reuses once ``corr`` is
        answered, so the receiver copies it out (extension code 5); else a
        one-shot object of exactly ``len(data)`` bytes that the receiver
        maps (extension code 4)."""
        ...


class OutOfBandReader(typing.Protocol):
    """The receiving side of :class:`OutOfBandWriter` (``pmetal.shm.READER``).
    Both methods raise ProtocolError for a name that is bad or gone."""

    def attach(self, name: str, nbytes: int) -> Any:
        """A read-only buffer of the one-shot object ``name`` (which it
        removes: nothing is left once the buffer is released)."""
        ...

    def read_slot(self, name: str, size: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the reusable slot ``name`` of ``size``
        bytes, valid until the next call (the caller copies them)."""
        ...


class _Default:
    """msgpack's ``default`` hook for one message: turns arrays into
    extension values and collects their buffers."""

    __slots__ = ("buffers", "chunk", "corr", "oob", "shm_min")

    def __init__(self, chunk: int, shm_min: int = 0, oob: OutOfBandWriter | None = None,
                 corr: int = 0) -> None:
        self.buffers: list[Any] = []
        self.chunk = chunk
        self.shm_min = shm_min if oob is not None else 0
        self.oob = oob
        self.corr = corr

    def __call__(self, obj: Any) -> Any:
        # numpy is looked up, not imported: a process that never imported it
        # (a node daemon) cannot hold arrays, and starts 0.1 s faster.
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            # dtype.name, not str(dtype): str() of a big-endian dtype is ">i4".
            return self._array(obj, _EXT_NUMPY, obj.dtype.name, obj)
        if isinstance(obj, Pickled):
            return msgpack.ExtType(_EXT_PICKLE, obj.data)
        if np is not None and isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return list(obj)
        mx = _mlx()
        if mx is not None and isinstance(obj, mx.array):
            dtype = str(obj.dtype).rpartition(".")[2]
            host = sys.modules["numpy"].array(
                obj.view(mx.uint16) if dtype == "bfloat16" else obj, copy=False)
            return self._array(host, _EXT_MLX, dtype, host)
        raise TypeError(f"cannot send a {type(obj).__name__} in a message; wrap it "
                        f"with pmetal.wire.Pickled.dumps(...) to send it by value")

    def _array(self, arr: Any, code: int, dtype: str, host: Any) -> msgpack.ExtType:
        import numpy as np
        if dtype not in (_MLX_DTYPES if code == _EXT_MLX else _DTYPES):
            raise TypeError(f"arrays of dtype {dtype} cannot be sent")
        if host.dtype.byteorder == ">":
            host = host.astype(host.dtype.newbyteorder("="))
        if not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)
        buffers, chunk = self.buffers, self.chunk
        first = len(buffers) + 1
        nbytes = host.nbytes
        if self.shm_min and nbytes >= self.shm_min:
            name, size, reusable = self.oob.put(  # type: ignore[union-attr]
                memoryview(host.reshape(-1)).cast("B"), self.corr)
            if reusable:
                return msgpack.ExtType(_EXT_SLOT, msgpack.packb(
                    [code, dtype, list(arr.shape), name, nbytes, size]))
            return msgpack.ExtType(_EXT_SHM, msgpack.packb(
                [code, dtype, list(arr.shape), name, nbytes]))
        if nbytes:
            flat = memoryview(host.reshape(-1)).cast("B")
            if nbytes <= chunk:
                buffers.append(flat)
            else:
                buffers.extend(flat[off:off + chunk] for off in range(0, nbytes, chunk))
        count = len(buffers) + 1 - first
        return msgpack.ExtType(code, msgpack.packb([dtype, list(arr.shape), first, count]))


def encode(body: Message, *, corr: int = 0, term: int | None = None,
           sender: str | None = None, limits: WireLimits = _DEFAULT_LIMITS,
           oob: OutOfBandWriter | None = None) -> list[Any]:
    """Frames for ``body``: ``[envelope, *buffers]`` (no seal).

    Buffers are memoryviews of the arrays' own memory (zero-copy); the caller
    must not modify the arrays until the frames have been sent. With an
    ``oob`` writer, arrays of at least ``limits.shm_min_bytes`` go there
    instead (extension codes 4 and 5); without one they travel as frames.
    """
    spec = _ENCODERS.get(type(body))
    if spec is None:
        spec = _encoder(type(body))
    raw = [PROTOCOL_VERSION, spec[0], corr, term, sender, spec[1](body)]
    try:
        # Most messages hold only msgpack's own types: a reused packer with
        # no ``default`` hook is twice as fast as packb. Anything else (an
        # array, a Pickled) raises TypeError and takes the full path.
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    try:
        envelope = packer.pack(raw)
    except TypeError:
        envelope = b""
    if envelope:
        if len(envelope) > limits.max_envelope_bytes:
            raise ProtocolError(f"envelope of {len(envelope)} bytes exceeds the limit of "
                                f"{limits.max_envelope_bytes}; send large data as arrays")
        return [envelope]
    default = _Default(limits.chunk_bytes, limits.shm_min_bytes, oob, corr)
    envelope = _packb(raw, default=default, use_bin_type=True)
    if len(envelope) > limits.max_envelope_bytes:
        raise ProtocolError(f"envelope of {len(envelope)} bytes exceeds the limit of "
                            f"{limits.max_envelope_bytes}; send large data as arrays")
    if default.buffers:
        return [envelope, *default.buffers]
    return [envelope]


_packb = msgpack.packb
_unpackb = msgpack.unpackb
_local = threading.local()   # one reusable msgpack.Packer per thread
_ENCODERS: dict[type, tuple[int, Callable[[Message], list[Any]]]] = {}


def _encoder(cls: type) -> tuple[int, Callable[[Message], list[Any]]]:
    if _REGISTRY.get(getattr(cls, "KIND", None)) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message")
    spec = (int(cls.KIND), _getter(cls))
    _ENCODERS[cls] = spec
    return spec


def _no_buffers_hook(allow_pickle: bool,
                     oob: OutOfBandReader | None) -> Callable[[int, bytes], Any]:
    def hook(code: int, data: bytes) -> Any:
        if code == _EXT_PICKLE and allow_pickle:
            return Pickled(data)
        return _ext_hook(allow_pickle, oob, [], [], code, data)
    return hook


def _ext_hook(allow_pickle: bool, oob: OutOfBandReader | None, buffers: list[memoryview],
              used: list[bool], code: int, data: bytes) -> Any:
    if code == _EXT_PICKLE:
        if not allow_pickle:
            raise ProtocolError("pickled payload from a peer that is not authenticated")
        return Pickled(data)
    if code in (_EXT_NUMPY, _EXT_MLX):
        return _unpack_array(code, data, buffers, used)
    if code in (_EXT_SHM, _EXT_SLOT):
        if oob is None:
            raise ProtocolError("shared-memory array from a peer that is not an authenticated "
                                "process of this host")
        return _attach_array(oob, data) if code == _EXT_SHM else _copy_slot(oob, data)
    raise ProtocolError(f"unknown extension type {code}")


# One hook per (allow_pickle, reader), made once: a message without buffer
# frames (nearly every one) allocates no hook of its own.
_HOOKS: dict[tuple[bool, Any], Callable[[int, bytes], Any]] = {
    (p, None): _no_buffers_hook(p, None) for p in (False, True)}


def _hook_for(allow_pickle: bool, oob: OutOfBandReader | None) -> Callable[[int, bytes], Any]:
    hook = _HOOKS.get((allow_pickle, oob))
    if hook is None:
        if len(_HOOKS) > 64:   # readers are long-lived singletons; this is a guard
            _HOOKS.clear()
        hook = _HOOKS[allow_pickle, oob] = _no_buffers_hook(allow_pickle, oob)
    return hook


def _host_dtype(code: int, dtype_name: Any) -> Any:
    """The numpy dtype an array of ``dtype_name`` travels as; refuses others."""
    import numpy as np
    if dtype_name not in (_MLX_DTYPES if code == _EXT_MLX else _DTYPES):
        raise ProtocolError(f"array dtype {dtype_name!r} is not allowed")
    return np.dtype("uint16" if dtype_name == "bfloat16" else dtype_name)


def _shm_header(data: bytes, slot: bool) -> tuple[int, str, tuple[int, ...], Any, str, int, int]:
    """Checked fields of a shared-memory array header (extension 4, or 5
    with ``slot``): code, dtype name, shape, host dtype, name, nbytes, size."""
    try:
        fields = msgpack.unpackb(data, raw=False)
        if type(fields) is not list or len(fields) != (6 if slot else 5):
            raise ValueError("wrong number of fields")
        code, dtype_name, shape, name, nbytes = fields[:5]
        size = fields[5] if slot else nbytes
        shape = tuple(shape)
        if not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 32:
            raise ValueError("bad shape")
        if type(name) is not str or type(nbytes) is not int or type(size) is not int \
                or code not in (_EXT_NUMPY, _EXT_MLX):
            raise ValueError("bad shared-memory reference")
    except Exception as exc:
        raise ProtocolError(f"malformed shared-memory array header: {exc}") from exc
    host_dtype = _host_dtype(code, dtype_name)
    if host_dtype.itemsize * math.prod(shape) != nbytes:
        raise ProtocolError(f"shared-memory array {dtype_name}{list(shape)} cannot hold "
                            f"{nbytes} bytes")
    return code, dtype_name, shape, host_dtype, name, nbytes, size


def _copy_slot(oob: OutOfBandReader, data: bytes) -> Any:
    """An array copied out of a reusable slot (its sender reuses the slot
    once our reply to the request that carried it has arrived)."""
    import numpy as np
    code, dtype_name, shape, host_dtype, name, nbytes, size = _shm_header(data, slot=True)
    arr = np.empty(shape, host_dtype)
    if nbytes:
        memoryview(arr.reshape(-1)).cast("B")[:] = oob.read_slot(name, size, nbytes)
    return _to_mlx(arr, dtype_name) if code == _EXT_MLX else arr


def _attach_array(oob: OutOfBandReader, data: bytes) -> Any:
    """An array mapped (read-only, not copied) from a one-shot object."""
    import numpy as np
    code, dtype_name, shape, host_dtype, name, nbytes, _ = _shm_header(data, slot=False)
    mapping = oob.attach(name, nbytes)  # also unlinks the name
    arr = (np.frombuffer(mapping, host_dtype).reshape(shape) if nbytes
           else np.empty(shape, host_dtype))
    return _to_mlx(arr, dtype_name) if code == _EXT_MLX else arr


def decode(frames: Sequence[Any], *, allow_pickle: bool = False,
           oob: OutOfBandReader | None = None,
           limits: WireLimits = _DEFAULT_LIMITS) -> Envelope:
    """Decode ``[envelope, *buffers]`` into an :class:`Envelope`.

    ``oob``: where arrays sent out of band are read from (shared memory,
    only for an authenticated peer on this host); without it such an array
    is malformed. Raises :class:`ProtocolError` for anything malformed.
    """
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    if type(head) is not bytes:
        head = frame_bytes(head)
    if len(head) > limits.max_envelope_bytes:
        raise ProtocolError(f"envelope of {len(head)} bytes exceeds the limit of "
                            f"{limits.max_envelope_bytes}")
    if len(frames) > 1:
        buffers = [frame_bytes(f) for f in frames[1:]]
        total = len(head) + sum(len(v) for v in buffers)
        if total > limits.max_message_bytes:
            raise ProtocolError(f"message of {total} bytes exceeds the limit of "
                                f"{limits.max_message_bytes}")
        used = [False] * len(buffers)
        hook = functools.partial(_ext_hook, allow_pickle, oob, buffers, used)
    else:
        used = []
        hook = _HOOKS.get((allow_pickle, oob)) or _hook_for(allow_pickle, oob)
    try:
        raw = _unpackb(head, raw=False, ext_hook=hook, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a dozen unrelated types on garbage
        raise ProtocolError(f"undecodable envelope: {type(exc).__name__}: {exc}") from exc

    if type(raw) is not list or len(raw) != 6:
        raise ProtocolError("envelope is not a 6-element array")
    version, kind, corr, term, sender, body = raw
    # Type first: comparing a decoded array with == yields an array, not a bool.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported "
                            f"(this node speaks {PROTOCOL_VERSION}); upgrade pmetal on "
                            f"every node to the same version")
    cls = _REGISTRY.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if type(corr) is not int or corr < 0:
        raise ProtocolError(f"bad correlation id {corr!r}")
    if term is not None and type(term) is not int:
        raise ProtocolError(f"bad term {term!r}")
    if sender is not None and type(sender) is not str:
        raise ProtocolError(f"bad sender {sender!r}")
    if used and not all(used):
        raise ProtocolError("message carries buffer frames no field refers to")
    if type(body) is not list:
        raise ProtocolError("body is not an array")
    required, checkers = _CHECKERS.get(cls) or _checkers(cls)
    if not required <= len(body) <= len(checkers):
        raise ProtocolError(f"{cls.__name__} expects {required}-{len(checkers)} fields, "
                            f"got {len(body)}")
    if cls in _UNCHECKED:  # every field is Any (Ping, Pong): nothing to check
        return _tuple_new(Envelope, (cls(*body), corr, term, sender))
    try:
        values = [v if check is None else check(v) for (_, check), v in zip(checkers, body)]
    except TypeError as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}") from exc
    return _tuple_new(Envelope, (cls(*values), corr, term, sender))


def _unpack_array(code: int, data: bytes, buffers: list[memoryview], used: list[bool]) -> Any:
    import numpy as np
    try:
        dtype_name, shape, first, count = msgpack.unpackb(data, raw=False)
        shape = tuple(shape)
        if not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 32:
            raise ValueError("bad shape")
        if type(first) is not int or type(count) is not int or count < 0:
            raise ValueError("bad frame reference")
    except Exception as exc:
        raise ProtocolError(f"malformed array header: {exc}") from exc
    host_dtype = _host_dtype(code, dtype_name)
    lo, hi = first - 1, first - 1 + count
    if count and (lo < 0 or hi > len(buffers) or any(used[lo:hi])):
        raise ProtocolError("array refers to missing or already used buffer frames")
    # math.prod on Python ints cannot wrap around like a uint64 product would.
    nbytes = host_dtype.itemsize * math.prod(shape)
    parts = buffers[lo:hi] if count else []
    if sum(len(p) for p in parts) != nbytes:
        raise ProtocolError(f"array {dtype_name}{list(shape)} needs {nbytes} bytes, "
                            f"its frames hold {sum(len(p) for p in parts)}")
    for i in range(lo, hi):
        used[i] = True
    if count == 0:
        arr = np.empty(shape, host_dtype)
    elif count == 1:
        arr = np.frombuffer(parts[0], host_dtype).reshape(shape)
    else:
        arr = np.empty(shape, host_dtype)
        out = memoryview(arr.reshape(-1)).cast("B")
        off = 0
        for p in parts:
            out[off:off + len(p)] = p
            off += len(p)
    return _to_mlx(arr, dtype_name) if code == _EXT_MLX else arr


def _to_mlx(arr: Any, dtype_name: str) -> Any:
    """The MLX array for a decoded host array (bfloat16 travels as uint16)."""
    mx = _mlx()
    if mx is None:
        import importlib
        try:
            mx = importlib.import_module("mlx.core")
        except ImportError as exc:
            raise ProtocolError("received an MLX array but MLX is not installed "
                                "here; install pmetal[mlx]") from exc
    # mx.array() narrows float64 to float32 unless told otherwise.
    out = mx.array(arr, dtype=mx.float64) if dtype_name == "float64" else mx.array(arr)
    return out.view(mx.bfloat16) if dtype_name == "bfloat16" else out
