"""What ``@pmetal.remote`` makes: remote functions, actor classes, handles."""

from __future__ import annotations

import inspect
from typing import Any

from pmetal.wire import ActorLocation, CreateActor

__all__ = ["ActorClass", "ActorHandle", "ActorMethod", "RemoteFunction", "remote"]

_OPTIONS = frozenset({"name", "node", "num_cpus", "resources", "max_restarts",
                      "max_concurrency", "num_returns", "lifetime", "namespace"})


def _check_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"{where}: unknown option(s) {sorted(unknown)}; "
                        f"known: {sorted(_OPTIONS)}")
    if options.get("num_returns", 1) != 1:
        raise ValueError(f"{where}: num_returns other than 1 is not supported yet")
    for key in ("num_cpus", "max_concurrency"):
        value = options.get(key)
        if value is not None and (type(value) not in (int, float) or value != value):
            raise TypeError(f"{where}: {key} must be a number, not {type(value).__name__} "
                            f"{value!r:.40}")
        if value is not None and value < 0:
            raise ValueError(f"{where}: {key} must not be negative")
    if options.get("lifetime") not in (None, "detached", "non_detached"):
        raise ValueError(f"{where}: lifetime must be 'detached', 'non_detached' or None, not "
                         f"{options['lifetime']!r}")
    res = options.get("resources") or {}
    if not isinstance(res, dict) or any(not isinstance(v, (int, float)) or v < 0
                                        for v in res.values()):
        raise ValueError(f"{where}: resources must map names to non-negative numbers")
    return options


_api: Any = None


def _client() -> Any:
    global _api
    if _api is None:  # pmetal.api imports this module: import it on first use
        from pmetal import api
        _api = api
    runtime = _api._runtime
    return runtime.client if runtime is not None else _api.client()


class RemoteFunction:
    """``f.remote(*args)`` runs ``f`` in a task worker and returns an ObjectRef."""

    def __init__(self, fn: Any, options: dict[str, Any]) -> None:
        self._fn = fn
        self._options = _check_options(options, f"@pmetal.remote {fn.__qualname__}")
        self._code: tuple[str, Any] | None = None
        self._placement_checked: Any = None   # the client that checked the resources
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", "remote_function")

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        from pmetal.actors.serialization import code_ref
        if self._code is None:
            self._code = code_ref(self._fn)
        fn_id, ref = self._code
        client = _client()
        if self._placement_checked is not client:
            client.check_placement(self._options, f"remote function {self._fn.__qualname__}")
            self._placement_checked = client
        return client.run_task(fn_id, ref, list(args), kwargs, self._fn.__qualname__)

    def options(self, **options: Any) -> RemoteFunction:
        return RemoteFunction(self._fn, {**self._options, **options})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"remote function {self.__name__} cannot be called directly; use "
                        f"{self.__name__}.remote(...)")


class ActorClass:
    """``Cls.remote(*args)`` creates an actor and returns its handle."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = _check_options(options, f"@pmetal.remote {cls.__qualname__}")
        self.__wrapped__ = cls
        self.__doc__ = cls.__doc__
        self.__name__ = cls.__name__

    def options(self, **options: Any) -> ActorClass:
        return ActorClass(self._cls, {**self._options, **options})

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        from pmetal.actors.serialization import code_ref
        client = _client()
        cls = self._cls
        cls_id, ref = code_ref(cls)
        methods = tuple(name for name, member in inspect.getmembers(cls, callable)
                        if not name.startswith("__"))
        is_async = any(inspect.iscoroutinefunction(m)
                       for _, m in inspect.getmembers(cls, inspect.isfunction))
        opts = dict(self._options)
        options = {"name": opts.get("name") or "", "node": opts.get("node") or "",
                   "num_cpus": opts.get("num_cpus") or 0,
                   "resources": dict(opts.get("resources") or {}),
                   "max_restarts": int(opts.get("max_restarts") or 0),
                   "max_concurrency": int(opts.get("max_concurrency") or 1),
                   "lifetime": opts.get("lifetime") or "",
                   "class_name": cls.__qualname__, "methods": list(methods),
                   "is_async": is_async}
        c_args, c_kwargs = client._resolve_args(list(args), kwargs)
        spec = CreateActor(client.new_actor_id(), cls_id, ref, c_args, c_kwargs, options)
        loc = client.create_actor(spec, timeout=client.config.transport.request_timeout)
        return ActorHandle(loc)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"actor class {self.__name__} cannot be instantiated directly; use "
                        f"{self.__name__}.remote(...)")


class ActorMethod:
    __slots__ = ("_handle", "_name")

    def __init__(self, handle: ActorHandle, name: str) -> None:
        self._handle = handle
        self._name = name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return _client().call(self._handle, self._name, list(args), kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"actor method {self._name} cannot be called directly; use "
                        f".{self._name}.remote(...)")


class ActorHandle:
    """A reference to a live actor; can be passed to other actors and tasks."""

    def __init__(self, loc: ActorLocation) -> None:
        self._actor_id = loc.actor_id
        self._update(loc)
        self._class_name = loc.class_name
        self._methods = frozenset(loc.methods)
        self._is_async = loc.is_async
        self._name = loc.name

    def _update(self, loc: ActorLocation) -> None:
        self._address = loc.address
        self._node_id = loc.node_id
        self._incarnation = loc.incarnation
        self._state = loc.state

    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._methods:
            raise AttributeError(f"actor {self._class_name} has no method {name!r} "
                                 f"(it has: {', '.join(sorted(self._methods)) or 'none'})")
        method = ActorMethod(self, name)
        self.__dict__[name] = method  # later lookups skip __getattr__
        return method

    def __reduce__(self) -> Any:
        loc = ActorLocation(self._actor_id, self._state, self._address, self._node_id,
                            self._incarnation, self._name, "", self._class_name,
                            tuple(sorted(self._methods)), self._is_async)
        return (_rebuild_handle, (loc.actor_id, loc.state, loc.address, loc.node_id,
                                  loc.incarnation, loc.name, loc.class_name, loc.methods,
                                  loc.is_async))

    def __repr__(self) -> str:
        return f"ActorHandle({self._class_name}, {self._actor_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorHandle) and other._actor_id == self._actor_id

    def __hash__(self) -> int:
        return hash(self._actor_id)


def _rebuild_handle(actor_id: str, state: str, address: str, node_id: str, incarnation: int,
                    name: str, class_name: str, methods: tuple[str, ...],
                    is_async: bool) -> ActorHandle:
    return ActorHandle(ActorLocation(actor_id, state, address, node_id, incarnation, name, "",
                                     class_name, methods, is_async))


def remote(*args: Any, **options: Any) -> Any:
    """``@pmetal.remote`` or ``@pmetal.remote(num_cpus=..., max_restarts=...)``
    on a function or a class."""
    def wrap(obj: Any) -> Any:
        if inspect.isclass(obj):
            return ActorClass(obj, options)
        if callable(obj):
            return RemoteFunction(obj, options)
        raise TypeError(f"@pmetal.remote applies to functions and classes, not "
                        f"{type(obj).__name__}")
    if len(args) == 1 and not options and (inspect.isclass(args[0]) or callable(args[0])):
        return wrap(args[0])
    if args:
        raise TypeError("use @pmetal.remote or @pmetal.remote(option=value, ...)")
    return wrap
