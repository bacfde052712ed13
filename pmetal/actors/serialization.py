"""How user values, functions, classes and exceptions cross process lines.

* Values: ``None``, bools, ints, floats, strings, bytes and numpy (or MLX)
  arrays travel natively (arrays as zero-copy buffer frames); anything else is
  shipped by value with cloudpickle inside an explicit
  :class:`~pmetal.wire.Pickled` payload, so tuples stay tuples and user
  classes stay themselves.
* Code: a function or class that the receiver can import travels by
  reference (``module:qualname``); one defined in ``__main__``, a closure or a
  lambda travels by value. Both are keyed by a stable id so a worker imports
  or unpickles each one once.
* Exceptions: a remote exception comes back as a :class:`RemoteError` that
  is also an instance of the original type when that type can be
  subclassed, and carries the remote traceback text. It travels pickled as
  usual when that round-trips; an exception that does not (its ``__init__``
  takes other arguments than its ``args``, as ``MyError(code, text)`` calling
  ``super().__init__(f"{code}: {text}")``) travels as its class, ``args`` and
  ``__dict__``, and is rebuilt without calling its ``__init__``.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from typing import Any

from pmetal.errors import RemoteError
from pmetal.wire import Pickled

__all__ = [
    "CodeCall",
    "CodeRef",
    "code_ref",
    "load_code",
    "load_exception",
    "pack_exception",
    "pack_value",
    "pack_values",
    "remote_error",
    "unpack_value",
    "unpack_values",
]

_NATIVE = (type(None), bool, int, float, str, bytes)


def _is_array(value: Any) -> bool:
    np = sys.modules.get("numpy")
    if np is not None and type(value) is np.ndarray:
        return value.dtype.kind in "biufc"
    mx = sys.modules.get("mlx.core")
    return mx is not None and isinstance(value, mx.array)


def pack_value(value: Any) -> Any:
    """A wire-ready form of ``value`` (see the module docstring)."""
    if type(value) in _NATIVE:
        if type(value) is int and not -(1 << 63) <= value < (1 << 64):
            return Pickled.dumps(value)  # msgpack integers are 64-bit
        return value
    if _is_array(value):
        return value
    try:
        return Pickled.dumps(value)
    except Exception as exc:  # cloudpickle raises many types for unpicklable objects
        raise TypeError(f"cannot send {type(value).__name__} object {value!r:.80}: it "
                        f"cannot be pickled ({type(exc).__name__}: {exc})") from exc


def unpack_value(value: Any) -> Any:
    return value.load() if isinstance(value, Pickled) else value


def pack_values(values: tuple[Any, ...] | list[Any]) -> list[Any]:
    return [pack_value(v) for v in values]


def unpack_values(values: list[Any] | tuple[Any, ...]) -> list[Any]:
    return [unpack_value(v) for v in values]


# --------------------------------------------------------------------- code

CodeRef = str | Pickled
"""``"module:qualname"`` for importable code, a Pickled payload otherwise."""


def code_ref(obj: Any) -> tuple[str, CodeRef]:
    """``(code id, reference)`` for a function or class."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        try:
            found = _resolve(module, qualname)
        except (ImportError, AttributeError):
            found = None
        # The module's name may hold the @pmetal.remote wrapper of obj.
        from pmetal.actors.handles import ActorClass, RemoteFunction
        if found is obj or (isinstance(found, (ActorClass, RemoteFunction))
                            and found.__wrapped__ is obj):
            ref = f"{module}:{qualname}"
            return ref, ref
    payload = Pickled.dumps(obj)
    return "pickle:" + hashlib.blake2b(payload.data, digest_size=12).hexdigest(), payload


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def load_code(ref: CodeRef) -> Any:
    """The function or class a :data:`CodeRef` names."""
    if isinstance(ref, Pickled):
        return ref.load()
    module, _, qualname = ref.partition(":")
    found = _resolve(module, qualname)
    from pmetal.actors.handles import ActorClass, RemoteFunction
    return found.__wrapped__ if isinstance(found, (ActorClass, RemoteFunction)) else found


class CodeCall:
    """A function named by its :data:`CodeRef`, loaded where it is first
    called. Wrappers around a remote function (its runtime_env, its
    generator mode) hold this rather than the function: a wrapper travels by
    value, and a function inside it would too, with copies of the module
    globals it names (a module-level counter or lock would no longer be the
    module's). An importable function thus still travels by reference."""

    __slots__ = ("__qualname__", "_loaded", "ref")

    def __init__(self, ref: CodeRef, qualname: str) -> None:
        self.ref = ref
        self.__qualname__ = qualname
        self._loaded: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._loaded
        if fn is None:
            fn = self._loaded = load_code(self.ref)
        return fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        return (CodeCall, (self.ref, self.__qualname__))

    def __repr__(self) -> str:
        return f"CodeCall({self.__qualname__})"


# ---------------------------------------------------------------- exceptions

_ERROR_CLASSES: dict[type, type] = {}


class _ExceptionState:
    """An exception's class, args and ``__dict__``: what is needed to rebuild
    one whose ``__init__`` cannot be called again with its ``args``."""

    __slots__ = ("args", "cls", "state")

    def __init__(self, cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> None:
        self.cls, self.args, self.state = cls, args, state

    def __reduce__(self) -> tuple:
        return (_ExceptionState, (self.cls, self.args, self.state))

    def rebuild(self) -> BaseException:
        return _bare_instance(self.cls, self.args, self.state)


def _bare_instance(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An instance of exception class ``cls`` holding ``args`` and ``state``,
    made without running its ``__init__`` (whose signature is unknown)."""
    try:
        err = cls.__new__(cls)
    except TypeError:   # a __new__ that needs its arguments (ExceptionGroup)
        err = cls.__new__(cls, *args)
    err.args = args
    if state:
        try:
            err.__dict__.update(state)
        except AttributeError:   # a class with __slots__ and no __dict__
            for key, value in state.items():
                setattr(err, key, value)
    return err


def pack_exception(exc: BaseException) -> Pickled | None:
    """``exc`` for a Failure: pickled as is when that round-trips, else as
    its class, args and ``__dict__``; None when even that cannot be pickled
    (the caller then gets a plain RemoteError with the text)."""
    try:
        payload = Pickled.dumps(exc)
        payload.load()   # an __init__ with other arguments fails here, not at the caller
    except Exception:  # any failure (cloudpickle and __init__ raise anything): use the state
        payload = None
    if payload is not None:
        return payload
    for state in (dict(getattr(exc, "__dict__", {})), {}):   # then without its attributes
        try:
            return Pickled.dumps(_ExceptionState(type(exc), tuple(exc.args), state))
        except Exception:  # cloudpickle raises many types for unpicklable objects
            continue
    return None


def load_exception(payload: Any) -> BaseException | None:
    """The exception a Failure carries, or None when it cannot be rebuilt
    here (its class is not importable in this process)."""
    try:
        obj = payload.load() if isinstance(payload, Pickled) else payload
        if isinstance(obj, _ExceptionState):
            obj = obj.rebuild()
    except Exception:  # unpickling user classes raises anything: the text still arrives
        return None
    return obj if isinstance(obj, BaseException) else None


def _reduce_dual(err: RemoteError) -> tuple:
    """Pickle a dual RemoteError as what rebuilds it, so that one re-raised
    by user code (an actor that calls another and lets its error through)
    still arrives as the original type."""
    cause = pack_exception(err.cause) if err.cause is not None else None
    return (_rebuild_dual, (err.error_type, err.remote_message, err.remote_traceback, cause))


def _rebuild_dual(error_type: str, message: str, traceback: str,
                  cause: Pickled | None) -> RemoteError:
    return remote_error(error_type, message, traceback,
                        load_exception(cause) if cause is not None else None)


def remote_error(error_type: str, message: str, traceback: str,
                 original: BaseException | None) -> RemoteError:
    """The exception to raise at ``get`` for a remote failure."""
    cls = type(original) if original is not None else None
    if cls is None or not issubclass(cls, Exception) or issubclass(cls, RemoteError):
        if isinstance(original, RemoteError):
            return original
        return RemoteError(error_type, message, traceback)
    dual = _ERROR_CLASSES.get(cls)
    if dual is None:
        try:
            dual = type(f"RemoteError({cls.__name__})", (RemoteError, cls), {
                "__init__": RemoteError.__init__, "__str__": RemoteError.__str__,
                "__reduce__": _reduce_dual, "__module__": __name__})
        except TypeError:  # a type that refuses to be subclassed (final, layout clash)
            return RemoteError(error_type, message, traceback, cause=original)
        _ERROR_CLASSES[cls] = dual
    err = _bare_instance(dual, original.args, dict(getattr(original, "__dict__", {})))
    RemoteError.__init__(err, error_type, message, traceback, cause=original)
    err.args = original.args
    return err
