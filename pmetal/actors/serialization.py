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
  subclassed, and carries the remote traceback text.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from typing import Any

from pmetal.errors import RemoteError
from pmetal.wire import Pickled

__all__ = [
    "CodeRef",
    "code_ref",
    "load_code",
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


# ---------------------------------------------------------------- exceptions

_ERROR_CLASSES: dict[type, type] = {}


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
                "__module__": __name__})
        except TypeError:  # a type that refuses to be subclassed (final, layout clash)
            return RemoteError(error_type, message, traceback, cause=original)
        _ERROR_CLASSES[cls] = dual
    err = dual.__new__(dual)
    try:
        err.__dict__.update(getattr(original, "__dict__", {}))
    except (AttributeError, TypeError):
        pass
    RemoteError.__init__(err, error_type, message, traceback, cause=original)
    err.args = original.args if original is not None else ()
    return err
