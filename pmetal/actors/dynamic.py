"""Generator tasks whose items become separate objects when the task ends:
Ray's ``num_returns="dynamic"`` and ``num_returns=N`` on a generator function.

``num_returns="streaming"`` (pmetal.actors.generators) hands the caller each
item as it is produced; these two older forms of Ray's run the generator to
its end in the worker first:

* ``num_returns="dynamic"``: the call's one ref resolves to a
  :class:`DynamicObjectRefGenerator`, the refs of the items in order. Each
  item is an object owned by the worker that ran the task (as a ``put`` in
  that task: the refs travel in the returned value and are borrowed by
  whoever holds them, as in Ray, where the worker owns them too). When the
  generator raises, the items before stay and one last ref holds the error:
  its ``get`` raises it (Ray: "the exception is stored in the final
  ObjectRef").
* ``num_returns=N`` on a generator function: the call returns N refs, one
  per item. The generator is read up to N items and then closed (Ray only
  logs an error when it would yield more); when it raises or ends before N,
  the refs after the last item fail with that error (or a PMetalValueError
  saying how many came).

Both work on remote functions (sync generators); actor methods take
``"streaming"``.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from pmetal.actors.refs import ItemFailed, ObjectRef
from pmetal.actors.serialization import remote_error
from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["DYNAMIC", "DynamicObjectRefGenerator", "ItemFailed", "generator_mode", "run_dynamic",
           "run_returns"]

DYNAMIC = "dynamic"


class DynamicObjectRefGenerator:
    """What a ``num_returns="dynamic"`` task's ref resolves to: the refs of
    the items its generator yielded, in order (iterate it, or ``len``).
    It can be passed to other tasks and actors; the refs in it are
    borrowed there like any ref inside a value."""

    def __init__(self, refs: list[ObjectRef]) -> None:
        self._refs = list(refs)

    def __iter__(self) -> Iterator[ObjectRef]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def __repr__(self) -> str:
        return f"DynamicObjectRefGenerator({len(self._refs)} refs)"


def _as_remote(exc: BaseException) -> BaseException:
    """``exc`` as a task's error reaches its caller: a RemoteError that is
    also of ``exc``'s type, with the worker's traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return remote_error(type(exc).__qualname__, str(exc), tb, exc)


def _made(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          how: str) -> Iterator[Any]:
    made = fn(*args, **kwargs)
    if not inspect.isgenerator(made):
        raise PMetalTypeError(f"{getattr(fn, '__qualname__', fn)} was called with {how} but "
                              f"returned {type(made).__name__}, not a generator; yield the "
                              f"items, or drop {how}")
    return made


def run_dynamic(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> DynamicObjectRefGenerator:
    """Run generator function ``fn`` to its end; its items as objects of
    this process (the worker), in a DynamicObjectRefGenerator."""
    refs = []
    made = _made(fn, args, kwargs, 'num_returns="dynamic"')
    try:
        for item in made:
            refs.append(ObjectRef.of_value(item))
    except Exception as exc:  # noqa: BLE001 - the user's error, kept in the last ref
        refs.append(ObjectRef.of_error(_as_remote(exc)))
    return DynamicObjectRefGenerator(refs)


def run_returns(count: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """The first ``count`` items of generator function ``fn``, the missing
    ones as ItemFailed (split into ``count`` refs by the caller)."""
    made = _made(fn, args, kwargs, f"num_returns={count}")
    items: list[Any] = []
    try:
        for item in made:
            items.append(item)
            if len(items) == count:
                break
    except Exception as exc:  # noqa: BLE001 - the user's error, in the refs not filled
        missing: BaseException = _as_remote(exc)
    else:
        missing = PMetalValueError(f"{getattr(fn, '__qualname__', fn)} was called with "
                                   f"num_returns={count} but yielded {len(items)} items")
    finally:
        made.close()
    return items + [ItemFailed(missing)] * (count - len(items))


def generator_mode(fn: Callable[..., Any], num_returns: Any,
                   call: Callable[..., Any] | None = None) -> Callable[..., Any] | None:
    """The wrapper a task of ``fn`` runs through for these forms (None: none),
    calling ``call`` (``fn`` as it travels: a CodeCall) or ``fn``."""
    if num_returns == DYNAMIC:
        if not inspect.isgeneratorfunction(fn):
            raise PMetalTypeError(f'{fn.__qualname__}: num_returns="dynamic" applies to a '
                                  f'generator function (one that yields)')
        return functools.partial(run_dynamic, call or fn)
    if type(num_returns) is int and num_returns > 1 and inspect.isgeneratorfunction(fn):
        return functools.partial(run_returns, num_returns, call or fn)
    return None
