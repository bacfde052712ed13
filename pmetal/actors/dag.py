"""Ray's DAG API (``ray.dag``): calls described with ``.bind()`` and run
with ``.execute()``.

``f.bind(x, y=z)`` on a remote function, ``Cls.bind(...)`` on an actor
class and ``handle.method.bind(...)`` or ``class_node.method.bind(...)``
build nodes instead of running anything; an argument may be another node
(its result is passed, as a ref) or the :class:`InputNode`, which stands for
what ``execute`` is given. ``node.execute(*args, **kwargs)`` then submits
every call the node depends on, each once, and returns what its own call
returns (an ObjectRef; an actor handle for a class node; a list for a
:class:`MultiOutputNode`), as Ray's ``DAGNode.execute`` does:

* a class node (``Cls.bind(...)``) creates a new actor at each ``execute``;
  its method nodes run in the order they were bound (each waits behind the
  one bound before it on the same class node, as in Ray, so that
  ``a.inc.bind(2)`` bound before ``a.get.bind()`` has run when ``get``
  runs, even if the DAG does not name it);
* a method bound on a live handle (``handle.method.bind(...)``) calls that
  actor, which outlives the DAG;
* ``InputNode()`` resolves to the single positional argument of
  ``execute``; ``inp[k]`` and ``inp.name`` to an item or attribute of it,
  or, when ``execute`` was given several arguments, to the k-th positional
  or the named keyword argument.

Everything runs through ``.remote()``: a DAG is a convenience for building
calls, not Ray's compiled graphs (``experimental_compile`` is absent). The
actors a class node creates are not ended when the execution's refs go
(Ray ends an actor once no handle to it is left; pmetal ends it with its
owner, the driver, or by ``pmetal.kill``).
"""

from __future__ import annotations

from typing import Any

from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["ClassMethodNode", "ClassNode", "DAGNode", "FunctionNode", "InputAttributeNode",
           "InputNode", "MultiOutputNode"]


class DAGNode:
    """A call (or an input) of a DAG; ``execute`` runs it and what it needs."""

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve(_Run(args, kwargs))

    def _resolve(self, run: _Run) -> Any:
        key = id(self)
        if key not in run.done:
            run.done[key] = self._execute(run)
        return run.done[key]

    def _execute(self, run: _Run) -> Any:   # pragma: no cover - every node overrides it
        raise NotImplementedError


class _Run:
    """One ``execute``: its input and the result of each node run so far."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs
        self.done: dict[int, Any] = {}


def _resolved(value: Any, run: _Run) -> Any:
    """``value`` with every node in it (also inside lists, tuples and dicts)
    replaced by its result."""
    if isinstance(value, DAGNode):
        return value._resolve(run)
    if isinstance(value, (list, tuple)):
        return type(value)(_resolved(v, run) for v in value)
    if isinstance(value, dict):
        return {k: _resolved(v, run) for k, v in value.items()}
    return value


class FunctionNode(DAGNode):
    """``f.bind(...)``: runs ``f.remote(...)``."""

    def __init__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._fn, self._args, self._kwargs = fn, args, kwargs

    def _execute(self, run: _Run) -> Any:
        return self._fn.remote(*_resolved(self._args, run), **_resolved(self._kwargs, run))

    def __repr__(self) -> str:
        return f"FunctionNode({self._fn.__name__})"


class ClassNode(DAGNode):
    """``Cls.bind(...)``: creates the actor (a new one at each ``execute``)."""

    def __init__(self, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._cls, self._args, self._kwargs = cls, args, kwargs
        self._last_call: ClassMethodNode | None = None

    def _execute(self, run: _Run) -> Any:
        return self._cls.remote(*_resolved(self._args, run), **_resolved(self._kwargs, run))

    def __getattr__(self, name: str) -> _UnboundMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        if not callable(getattr(self._cls.__wrapped__, name, None)):
            raise AttributeError(f"actor class {self._cls.__name__} has no method {name!r}")
        return _UnboundMethod(self, name)

    def __repr__(self) -> str:
        return f"ClassNode({self._cls.__name__})"


class _UnboundMethod:
    """``class_node.method``, waiting for its ``.bind(...)``."""

    def __init__(self, actor: ClassNode | Any, name: str) -> None:
        self._actor, self._name = actor, name

    def bind(self, *args: Any, **kwargs: Any) -> ClassMethodNode:
        return ClassMethodNode(self._actor, self._name, args, kwargs)


class ClassMethodNode(DAGNode):
    """``actor.method.bind(...)``: runs ``handle.method.remote(...)`` on the
    actor of a class node (behind the call bound before it there) or on a
    live handle."""

    def __init__(self, actor: ClassNode | Any, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self._actor, self._name, self._args, self._kwargs = actor, name, args, kwargs
        self._previous: ClassMethodNode | None = None
        if isinstance(actor, ClassNode):
            self._previous, actor._last_call = actor._last_call, self

    def _execute(self, run: _Run) -> Any:
        handle = _resolved(self._actor, run)
        if self._previous is not None:
            self._previous._resolve(run)   # submitted first: an actor runs calls in order
        args, kwargs = _resolved(self._args, run), _resolved(self._kwargs, run)
        return getattr(handle, self._name).remote(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ClassMethodNode({self._name})"


class InputNode(DAGNode):
    """What ``execute`` is given; ``with InputNode() as inp:`` as in Ray."""

    def __enter__(self) -> InputNode:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def _execute(self, run: _Run) -> Any:
        if len(run.args) == 1 and not run.kwargs:
            return run.args[0]
        if not run.args and not run.kwargs:
            raise PMetalValueError("this DAG has an InputNode: give execute() its input, "
                                   "e.g. dag.execute(2)")
        return _Inputs(run.args, run.kwargs)

    def __getitem__(self, key: Any) -> InputAttributeNode:
        return InputAttributeNode(self, key, "__getitem__")

    def __getattr__(self, name: str) -> InputAttributeNode:
        if name.startswith("_"):
            raise AttributeError(name)
        return InputAttributeNode(self, name, "__getattr__")

    def __repr__(self) -> str:
        return "InputNode()"


class _Inputs:
    """The input of an ``execute`` given several arguments."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


class InputAttributeNode(DAGNode):
    """``inp[key]`` or ``inp.name`` of an :class:`InputNode`."""

    def __init__(self, source: InputNode, key: Any, how: str) -> None:
        self._source, self._key, self._how = source, key, how

    def _execute(self, run: _Run) -> Any:
        value = self._source._resolve(run)
        key = self._key
        try:
            if isinstance(value, _Inputs):
                return value.args[key] if isinstance(key, int) else value.kwargs[key]
            if self._how == "__getitem__":
                return value[key]
            return getattr(value, key)
        except (LookupError, AttributeError, TypeError) as exc:
            raise PMetalValueError(f"the DAG's input has no {key!r} ({exc}); execute() was "
                                   f"given {len(run.args)} positional argument(s) and "
                                   f"keywords {sorted(run.kwargs)}") from exc

    def __repr__(self) -> str:
        return f"InputAttributeNode({self._key!r})"


class MultiOutputNode(DAGNode):
    """Several nodes' results as one list: ``execute`` returns their refs."""

    def __init__(self, outputs: list[DAGNode] | tuple[DAGNode, ...]) -> None:
        if not isinstance(outputs, (list, tuple)) or not all(
                isinstance(o, DAGNode) for o in outputs):
            raise PMetalTypeError(f"MultiOutputNode takes a list of DAG nodes (made with "
                                  f".bind()), not {outputs!r:.80}")
        self._outputs = list(outputs)

    def _execute(self, run: _Run) -> Any:
        return [o._resolve(run) for o in self._outputs]

    def __repr__(self) -> str:
        return f"MultiOutputNode({len(self._outputs)} outputs)"
