"""What ``@pmetal.remote`` makes: remote functions, actor classes, handles."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any

from pmetal.actors import context, strategies
from pmetal.actors.dynamic import DYNAMIC, generator_mode
from pmetal.actors.generators import (STREAMING, check_window, stream_actor_call,
                                      stream_task)
from pmetal.actors.refs import ObjectRef, split_ref
from pmetal.actors.runtime_env import (SETUP_HOOK, call_with_env, call_with_setup_hook,
                                       check_runtime_env, job_setup_hook, job_working_dir,
                                       merged_env_vars, stream_with_env, working_dir_spec)
from pmetal.actors.strategies import PG_OPTIONS, captured, placement_options, task_strategy
from pmetal.actors.workdir import WorkingDirTask
from pmetal.actors.workdir import sources as workdir_sources
from pmetal.errors import NotInitializedError, PlacementError, PMetalTypeError, PMetalValueError
from pmetal.values import ActorState
from pmetal.wire import ActorLocation, CreateActor, Pickled

__all__ = ["ACTOR_OPTIONS", "ActorClass", "ActorHandle", "ActorMethod", "DEFAULT_MAX_RETRIES",
           "FUNCTION_OPTIONS", "RemoteFunction", "check_num_returns", "check_options", "method",
           "needed_resources", "remote"]

# Options, as in Ray. "num_returns", "lifetime" and "namespace" are accepted
# for compatibility (see docs/api.md for what each does today).
_COMMON = frozenset({"num_cpus", "num_gpus", "memory", "resources", "num_returns", "name",
                     "runtime_env", "scheduling_strategy", *PG_OPTIONS})
ACTOR_OPTIONS = _COMMON | {"node", "max_restarts", "max_task_retries", "max_concurrency",
                           "lifetime", "namespace", "get_if_exists"}
FUNCTION_OPTIONS = _COMMON | {"max_retries", "retry_exceptions",
                              "_generator_backpressure_num_objects"}

log = logging.getLogger(__name__)

DEFAULT_MAX_RETRIES = 3
"""Ray's default: a task is re-run up to 3 times when its worker dies."""


def _number(options: dict[str, Any], key: str, where: str, low: float) -> None:
    value = options.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PMetalTypeError(f"{where}: {key} must be a number, not {type(value).__name__} "
                              f"{value!r:.40}")
    if not value >= low:   # also refuses NaN
        raise PMetalValueError(f"{where}: {key}={value!r}; it must be at least {low:g}")


def _integer(options: dict[str, Any], key: str, where: str, low: int) -> None:
    value = options.get(key)
    if value is None:
        return
    if type(value) is not int:
        raise PMetalTypeError(f"{where}: {key} must be an int, not {type(value).__name__} "
                              f"{value!r:.40}")
    if value < low:
        raise PMetalValueError(f"{where}: {key}={value}; it must be at least {low}"
                               + (" (-1: without limit)" if low == -1 else ""))


def check_num_returns(value: Any, where: str, dynamic: bool = False) -> None:
    """``num_returns``: None, an int >= 1 (a call then returns that many
    refs, one per item of the returned sequence, or of a generator
    function's items) or ``"streaming"`` (an ObjectRefGenerator, see
    pmetal.actors.generators); Ray's older ``"dynamic"`` where ``dynamic``
    (remote functions: pmetal.actors.dynamic), else refused by name."""
    if value is None or value == STREAMING or (dynamic and value == DYNAMIC):
        return
    if value == DYNAMIC:
        raise PMetalValueError(f"{where}: num_returns='dynamic' (Ray's older generator "
                               f"tasks) works on remote functions, not here; use "
                               f"num_returns='streaming': the call returns an "
                               f"ObjectRefGenerator to iterate for the refs")
    if type(value) is not int:
        raise PMetalTypeError(f"{where}: num_returns must be an int, not "
                              f"{type(value).__name__} {value!r:.40}")
    if value < 1:
        raise PMetalValueError(f"{where}: num_returns={value}; it must be at least 1")


def check_options(options: dict[str, Any], where: str, known: frozenset[str]) -> dict[str, Any]:
    """Refuse unknown options (typos) and values of the wrong type or range."""
    unknown = set(options) - known
    if unknown:
        other = ACTOR_OPTIONS if known is FUNCTION_OPTIONS else FUNCTION_OPTIONS
        elsewhere = sorted(unknown & other)
        hint = (f" ({', '.join(elsewhere)}: only for "
                f"{'actors' if known is FUNCTION_OPTIONS else 'remote functions'})"
                if elsewhere else "")
        raise PMetalTypeError(f"{where}: unknown option(s) {sorted(unknown)}{hint}; "
                              f"valid: {sorted(known)}")
    check_num_returns(options.get("num_returns"), where, dynamic=known is FUNCTION_OPTIONS)
    check_window(options.get("_generator_backpressure_num_objects"), where)
    _number(options, "num_cpus", where, 0)
    _number(options, "num_gpus", where, 0)
    _number(options, "memory", where, 0)   # bytes, as in Ray
    _integer(options, "max_concurrency", where, 1)
    for key in ("max_restarts", "max_task_retries", "max_retries"):
        _integer(options, key, where, -1)
    if options.get("lifetime") not in (None, "detached", "non_detached"):
        raise PMetalValueError(f"{where}: lifetime must be 'detached', 'non_detached' or None, "
                               f"not {options['lifetime']!r}")
    res = options.get("resources") or {}
    if not isinstance(res, dict) or any(
            type(k) is not str or isinstance(v, bool) or not isinstance(v, (int, float))
            or not v >= 0 for k, v in res.items()):
        raise PMetalValueError(f"{where}: resources must map names to non-negative numbers, "
                               f"not {res!r}")
    for key, option in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("memory", "memory")):
        if key in res and options.get(option) is not None:
            raise PMetalValueError(f"{where}: {key} given twice, as {option} and in resources")
    for key in ("name", "node"):
        if options.get(key) is not None and type(options[key]) is not str:
            raise PMetalTypeError(f"{where}: {key} must be a str, not "
                                  f"{type(options[key]).__name__}")
    if options.get("get_if_exists") is not None and type(options["get_if_exists"]) is not bool:
        raise PMetalTypeError(f"{where}: get_if_exists must be True or False, not "
                              f"{options['get_if_exists']!r:.40}")
    if "scheduling_strategy" in options or any(k in options for k in PG_OPTIONS):
        placement_options(options, where)
    check_runtime_env(options.get("runtime_env"), where)
    if SETUP_HOOK in (options.get("runtime_env") or {}):
        raise PMetalValueError(f"{where}: runtime_env[{SETUP_HOOK!r}] is the job's, as in "
                               f"Ray: give it to pmetal.init(runtime_env=...)")
    retry_on = options.get("retry_exceptions")
    if retry_on is not None and type(retry_on) is not bool and not (
            isinstance(retry_on, (list, tuple)) and all(
                isinstance(t, type) and issubclass(t, BaseException) for t in retry_on)):
        raise PMetalTypeError(f"{where}: retry_exceptions must be True, False or a list of "
                              f"exception classes, not {retry_on!r}")
    return options


def needed_resources(options: dict[str, Any]) -> dict[str, float]:
    """The resources ``options`` reserve: ``resources`` plus CPU, GPU and
    memory (the node's ``memory`` resource, in bytes)."""
    need = {k: float(v) for k, v in (options.get("resources") or {}).items()}
    for key, option in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("memory", "memory")):
        if options.get(option):
            need[key] = float(options[option])
    return need


_client = context.current   # this process's client; auto-init starts a node if none


class RemoteFunction:
    """``f.remote(*args)`` runs ``f`` in a task worker and returns an ObjectRef."""

    def __init__(self, fn: Any, options: dict[str, Any]) -> None:
        self._fn = fn
        self._options = check_options(options, f"@pmetal.remote {fn.__qualname__}",
                                      FUNCTION_OPTIONS)
        retries = options.get("max_retries")
        self._max_retries = DEFAULT_MAX_RETRIES if retries is None else retries
        retry_on = options.get("retry_exceptions") or False
        self._retry_exceptions = retry_on if retry_on is True else tuple(retry_on or ())
        self._code: tuple[str, Any] | None = None
        self._env_code: dict[Any, tuple[str, Any]] = {}
        self._working_dir = working_dir_spec(options.get("runtime_env"),
                                             f"@pmetal.remote {fn.__qualname__}")
        self._placement_checked: Any = None   # the client that checked the resources
        # Where its tasks run: None is the caller's node (the fast path).
        self._strategy = task_strategy(self._options, f"@pmetal.remote {fn.__qualname__}")
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", "remote_function")

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        from pmetal.actors.serialization import code_ref
        client = _client()   # first: auto-init may set the job's runtime_env
        env_vars = merged_env_vars(self._options, f"{self._fn.__qualname__}.remote()")
        # As in Ray (2.8 on), a generator function streams unless told otherwise.
        num_returns = self._options.get("num_returns") or (
            STREAMING if _is_generator(self._fn) else 1)
        working_dir = self._working_dir or job_working_dir()
        hook = job_setup_hook()
        if env_vars or working_dir or hook:
            # The worker runs fn through call_with_env: the variables are set
            # for this call only (one code id per environment); a generator's
            # while it runs (stream_with_env). With a working_dir, fn is
            # loaded in the worker once the folder is in place (WorkingDirTask).
            # The job's setup hook runs first, once per worker process.
            key = (tuple(sorted(env_vars.items())), working_dir and working_dir["sha256"],
                   client.node_address, hook and hook[0], num_returns)
            if key not in self._env_code:
                call = self._by_ref()
                target: Any = generator_mode(self._fn, num_returns, call) or call
                if hook:
                    target = functools.partial(call_with_setup_hook, hook, target)
                if env_vars:
                    wrap = stream_with_env if num_returns == STREAMING else call_with_env
                    target = functools.partial(wrap, env_vars, target)
                if working_dir:
                    where = f"{self._fn.__qualname__}.remote()"
                    target = WorkingDirTask(workdir_sources(working_dir, client, where),
                                            Pickled.dumps(target))
                self._env_code[key] = code_ref(target)
            fn_id, ref = self._env_code[key]
        elif num_returns == DYNAMIC or (type(num_returns) is int and num_returns > 1):
            # A generator task's items, one object each (pmetal.actors.dynamic).
            if num_returns not in self._env_code:
                mode = generator_mode(self._fn, num_returns, self._by_ref())
                self._env_code[num_returns] = code_ref(mode or self._fn)
            fn_id, ref = self._env_code[num_returns]
        else:
            if self._code is None:
                self._code = code_ref(self._fn)
            fn_id, ref = self._code
        count = num_returns if type(num_returns) is int else 1   # refs returned
        strategy = self._strategy
        if strategy is None and strategies._capture is not None:   # in a capturing actor
            strategy = captured(self._options)
        if strategy is not None and num_returns == STREAMING:
            from pmetal.actors.routing import stream_place
            return stream_task(client, fn_id, ref, list(args), kwargs, self._fn.__qualname__,
                               check_window(self._options.get(
                                   "_generator_backpressure_num_objects"), ""),
                               where=stream_place(client, strategy, self))
        if strategy is not None:   # SPREAD, a node or a placement group
            from pmetal.actors.routing import run_placed
            return split_ref(run_placed(client, strategy, self, env_vars, (fn_id, ref),
                                        list(args), kwargs), count)
        if self._placement_checked is not client:
            try:
                client.check_placement(needed_resources(self._options),
                                       f"remote function {self._fn.__qualname__}")
            except PlacementError as exc:
                return _infeasible(exc, num_returns if num_returns == STREAMING else count)
            self._placement_checked = client
        if num_returns == STREAMING:
            return stream_task(client, fn_id, ref, list(args), kwargs, self._fn.__qualname__,
                               check_window(self._options.get(
                                   "_generator_backpressure_num_objects"), ""))
        result = client.run_task(fn_id, ref, list(args), kwargs, self._fn.__qualname__,
                                 self._max_retries, self._retry_exceptions)
        return split_ref(result, count)

    def _by_ref(self) -> Any:
        """The function as wrappers hold it: a CodeCall, by reference when
        importable (pmetal.actors.serialization.CodeCall)."""
        from pmetal.actors.serialization import CodeCall, code_ref
        if self._code is None:
            self._code = code_ref(self._fn)
        return CodeCall(self._code[1], self._fn.__qualname__)

    def options(self, **options: Any) -> RemoteFunction:
        return RemoteFunction(self._fn, {**self._options, **options})

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A DAG node of this call (Ray's ``ray.dag``; see pmetal.actors.dag)."""
        from pmetal.actors.dag import FunctionNode
        return FunctionNode(self, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PMetalTypeError(f"remote function {self.__name__} cannot be called directly; use "
                        f"{self.__name__}.remote(...)")


def _infeasible(error: PlacementError, num_returns: int | str) -> Any:
    """What ``.remote()`` of a task that no node can run returns: its
    ref(s), failed with ``error``, and a warning in the log now.

    Ray leaves such a task pending until a node with the resources joins
    (its autoscaler may add one), warns, and lets the script go on; a
    script that never asks for the result ends normally. pmetal goes on as
    well, but does not leave the task pending: nothing in pmetal waits
    forever, and a home cluster grows by hand, not by an autoscaler. So the
    PlacementError is raised by the first ``get`` (with or without a
    timeout: at once, never after one), and ``wait`` counts the ref as done.
    To run it on a machine that is joining, wait for it first
    (``pmetal.wait_for_peers``) and call ``.remote()`` again."""
    if num_returns == STREAMING:   # a stream has no ref to hold the error
        raise error
    log.warning("%s; the task is not run: pmetal.get of its ref raises PlacementError",
                error)
    return split_ref(ObjectRef.of_error(error), num_returns)


class ActorClass:
    """``Cls.remote(*args)`` creates an actor and returns its handle."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self._cls = cls
        self._options = check_options(options, f"@pmetal.remote {cls.__qualname__}",
                                      ACTOR_OPTIONS)
        if (options.get("num_returns") or 1) != 1:
            raise PMetalValueError(f"@pmetal.remote {cls.__qualname__}: num_returns applies to "
                                   f"remote functions and actor methods (@pmetal.method), not "
                                   f"to creating an actor")
        self._working_dir = working_dir_spec(options.get("runtime_env"),
                                             f"@pmetal.remote {cls.__qualname__}")
        self.__wrapped__ = cls
        self.__doc__ = cls.__doc__
        self.__name__ = cls.__name__

    def options(self, **options: Any) -> ActorClass:
        return ActorClass(self._cls, {**self._options, **options})

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A DAG node that creates this actor at each ``execute`` (pmetal.actors.dag)."""
        from pmetal.actors.dag import ClassNode
        return ClassNode(self, args, kwargs)

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        if self._options.get("get_if_exists"):
            return self._get_or_create(args, kwargs)
        return self._create(_client(), args, kwargs)

    def _get_or_create(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ActorHandle:
        """Ray's ``.options(name=..., get_if_exists=True).remote()``: the live
        actor of that name if there is one (its constructor arguments are then
        not used), else a new one. When another process creates it meanwhile,
        the creation here is refused and the lookup runs again."""
        name = self._options.get("name")
        if not name:
            raise PMetalValueError(f"{self._cls.__qualname__}.options(get_if_exists=True) "
                                   f"needs name=...: the existing actor is found by its name")
        client = _client()
        deadline = time.monotonic() + client.config.transport.request_timeout
        while True:
            try:
                loc = client.lookup(name=name)
                if loc.state != ActorState.DEAD:
                    return ActorHandle(loc, client)
            except PMetalValueError:
                pass   # no actor of that name: create it
            try:
                return self._create(client, args, kwargs)
            except ValueError as exc:
                # Someone took the name between the lookup and the creation
                # (or is still running its constructor): look again.
                if "already exists" not in str(exc) or time.monotonic() >= deadline:
                    raise
                threading.Event().wait(0.05)

    def _create(self, client: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ActorHandle:
        from pmetal.actors.serialization import code_ref
        cls = self._cls
        cls_id, ref = code_ref(cls)
        methods = tuple(_method_entry(name, member)
                        for name, member in inspect.getmembers(cls, callable)
                        if not name.startswith("__"))
        is_async = any(inspect.iscoroutinefunction(m)
                       for _, m in inspect.getmembers(cls, inspect.isfunction))
        opts = dict(self._options)
        if strategies._capture is not None and captured(opts) is not None:
            opts["scheduling_strategy"] = captured(opts)   # made by a capturing actor
        resources = dict(opts.get("resources") or {})
        if opts.get("num_gpus"):
            resources["GPU"] = float(opts["num_gpus"])
        if opts.get("memory"):   # held against the node's "memory" like num_cpus
            resources["memory"] = float(opts["memory"])
        options = {"name": opts.get("name") or "",
                   **placement_options(opts, f"{cls.__qualname__}.remote()"),
                   "num_cpus": opts.get("num_cpus") or 0,
                   "resources": resources,
                   "max_restarts": int(opts.get("max_restarts") or 0),
                   "max_task_retries": int(opts.get("max_task_retries") or 0),
                   "max_concurrency": int(opts.get("max_concurrency") or 1),
                   "lifetime": opts.get("lifetime") or "",
                   "class_name": cls.__qualname__, "methods": list(methods),
                   "is_async": is_async}
        env_vars = merged_env_vars(opts, f"{cls.__qualname__}.remote()")
        working_dir = self._working_dir or job_working_dir()
        hook = job_setup_hook()
        if env_vars or working_dir or hook:   # set in the worker before the class is loaded
            options["runtime_env"] = {"env_vars": env_vars}
            if hook:
                options["runtime_env"][SETUP_HOOK] = list(hook)
            if working_dir:
                options["runtime_env"]["working_dir"] = workdir_sources(
                    working_dir, client, f"{cls.__qualname__}.remote()")
        c_args, c_kwargs = client._resolve_args(list(args), kwargs)
        spec = CreateActor(client.new_actor_id(), cls_id, ref, c_args, c_kwargs, options)
        loc = client.create_actor(spec, timeout=client.config.transport.request_timeout)
        return ActorHandle(loc, client)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PMetalTypeError(f"actor class {self.__name__} cannot be instantiated directly; use "
                        f"{self.__name__}.remote(...)")


def method(*, num_returns: int | str | None = None,
           _generator_backpressure_num_objects: int | None = None,
           enable_task_events: bool = True, tensor_transport: str | None = None) -> Any:
    """``@pmetal.method(num_returns=N)`` on an actor method, as Ray's
    ``@ray.method``: a call of it returns N refs, one per item of the tuple
    the method returns; ``num_returns="streaming"`` (the default for a
    generator method, as in Ray) returns an ObjectRefGenerator, which lets
    the generator run at most ``_generator_backpressure_num_objects`` items
    ahead of the caller. ``enable_task_events`` is accepted for Ray's
    scripts and changes nothing (pmetal records no task events).
    ``tensor_transport`` (Ray's direct transports) must name a transport
    registered with ``pmetal.experimental.register_tensor_transport`` (or
    ``"object_store"``); the value moves the way every value does (see
    pmetal.actors.tensor_transports)."""
    from pmetal.actors.tensor_transports import check_tensor_transport
    check_tensor_transport(tensor_transport, "@pmetal.method")
    if type(enable_task_events) is not bool:
        raise PMetalTypeError(f"@pmetal.method: enable_task_events must be True or False, "
                              f"not {enable_task_events!r:.40}")
    check_num_returns(num_returns, "@pmetal.method")
    window = _generator_backpressure_num_objects
    if window is not None:
        check_window(window, "@pmetal.method")
        if num_returns not in (None, STREAMING):
            raise PMetalValueError("@pmetal.method: _generator_backpressure_num_objects "
                                   "applies to num_returns='streaming' only")

    def wrap(fn: Any) -> Any:
        if not callable(fn):
            raise PMetalTypeError(f"@pmetal.method applies to methods, not "
                                  f"{type(fn).__name__}")
        if window is not None:
            fn.__pmetal_num_returns__ = f"{STREAMING}:{window}"
        elif num_returns is not None:
            fn.__pmetal_num_returns__ = num_returns
        return fn
    return wrap


def _is_generator(fn: Any) -> bool:
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


def _method_entry(name: str, member: Any) -> str:
    """How a method travels in the actor's method list (kept by its node, so
    that a handle from get_actor or a pickled one knows it too):
    ``"name"``, ``"name/N"`` for ``@pmetal.method(num_returns=N)``, or
    ``"name/streaming"`` (``"name/streaming:W"`` with a backpressure
    window W) for a generator method (no method name holds a "/")."""
    count = getattr(member, "__pmetal_num_returns__", None)
    if count is None:
        count = STREAMING if _is_generator(member) else 1
    return name if count == 1 else f"{name}/{count}"


def _parse_methods(entries: tuple[str, ...]) -> dict[str, int | str]:
    """Method name -> num_returns, from the entries of ``_method_entry``
    (``"streaming"`` or ``"streaming:W"`` for a generator method)."""
    out: dict[str, int | str] = {}
    for entry in entries:
        name, _, count = entry.partition("/")
        out[name] = (int(count) if count.isdigit() else
                     count if count.startswith(STREAMING) else 1)
    return out


class ActorMethod:
    __slots__ = ("_handle", "_name", "_num_returns", "_window")

    def __init__(self, handle: ActorHandle, name: str, num_returns: int | str = 1,
                 window: int | None = None) -> None:
        self._handle = handle
        self._name = name
        if isinstance(num_returns, str) and ":" in num_returns:   # "streaming:W"
            num_returns, _, w = num_returns.partition(":")
            window = int(w) if w.isdigit() else None
        self._num_returns = num_returns
        self._window = window

    def options(self, **options: Any) -> ActorMethod:
        """``handle.method.options(num_returns=N).remote(...)``, as in Ray;
        num_returns (and ``_generator_backpressure_num_objects`` for
        ``"streaming"``) are the only method options pmetal has."""
        valid = {"num_returns", "_generator_backpressure_num_objects"}
        unknown = set(options) - valid
        if unknown:
            raise PMetalTypeError(f"actor method {self._name}: unknown option(s) "
                                  f"{sorted(unknown)}; valid: {sorted(valid)}")
        count = options.get("num_returns", self._num_returns)
        where = f"actor method {self._name}"
        check_num_returns(count, where)
        window = options.get("_generator_backpressure_num_objects", self._window)
        if window is not None:
            check_window(window, where)
        return ActorMethod(self._handle, self._name, count, window)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._handle
        origin = handle._origin
        client = _client() if origin is None or not origin.closed else _after_shutdown(handle)
        if self._num_returns == STREAMING:
            return stream_actor_call(client, handle, self._name, list(args), kwargs,
                                     check_window(self._window, ""))
        return split_ref(client.call(handle, self._name, list(args), kwargs), self._num_returns)

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A DAG node of this call on the live actor (pmetal.actors.dag)."""
        from pmetal.actors.dag import ClassMethodNode
        return ClassMethodNode(self._handle, self._name, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PMetalTypeError(f"actor method {self._name} cannot be called directly; use "
                        f".{self._name}.remote(...)")


class ActorHandle:
    """A reference to a live actor; can be passed to other actors and tasks."""

    def __init__(self, loc: ActorLocation, origin: Any = None) -> None:
        self._actor_id = loc.actor_id
        # The client this handle came from in this process (None: it came
        # from elsewhere, pickled): a call after that client's shutdown
        # raises at once instead of reaching for a worker that is gone.
        self._origin = origin
        # Calls that fail because the actor died are sent again to its next
        # incarnation this many times (Ray's max_task_retries; -1: no limit).
        # The actor's node keeps it, so a handle from get_actor has it too.
        self._max_task_retries = loc.max_task_retries
        self._update(loc)
        self._class_name = loc.class_name
        self._returns = _parse_methods(loc.methods)   # name -> num_returns
        self._methods = frozenset(self._returns)
        self._is_async = loc.is_async
        self._name = loc.name

    def _update(self, loc: ActorLocation) -> None:
        self._address = loc.address
        self._node_id = loc.node_id
        self._incarnation = loc.incarnation
        self._state = loc.state

    def __getattr__(self, name: str) -> ActorMethod:
        if name == "__ray_ready__":   # Ray's: resolves to True once the actor is up
            return ActorMethod(self, name)
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._methods:
            raise AttributeError(f"actor {self._class_name} has no method {name!r} "
                                 f"(it has: {', '.join(sorted(self._methods)) or 'none'})")
        method = ActorMethod(self, name, self._returns[name])
        self.__dict__[name] = method  # later lookups skip __getattr__
        return method

    def __reduce__(self) -> Any:
        loc = ActorLocation(self._actor_id, self._state, self._address, self._node_id,
                            self._incarnation, self._name, "", self._class_name,
                            tuple(sorted(name if count == 1 else f"{name}/{count}"
                                         for name, count in self._returns.items())),
                            self._is_async)
        return (_rebuild_handle, (loc.actor_id, loc.state, loc.address, loc.node_id,
                                  loc.incarnation, loc.name, loc.class_name, loc.methods,
                                  loc.is_async, self._max_task_retries))

    def __repr__(self) -> str:
        return f"ActorHandle({self._class_name}, {self._actor_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorHandle) and other._actor_id == self._actor_id

    def __hash__(self) -> int:
        return hash(self._actor_id)


def _after_shutdown(handle: ActorHandle) -> Any:
    """The client for a call on ``handle`` whose client was shut down:
    NotInitializedError at once when nothing is connected (auto-init would
    start a node that does not know the actor); else the client of the new
    session, which asks its node where the actor is (it may be a detached
    actor still alive) before it dials any address."""
    client = context.current_or_none()
    if client is None and not context.in_worker():
        raise NotInitializedError(
            f"pmetal is shut down: {handle!r} belongs to the session that "
            f"pmetal.shutdown() ended; call pmetal.init() first (its actor ended with that "
            f"session unless it was created with lifetime='detached')")
    handle._origin = None   # unknown to this session: its client looks it up first
    return _client()


def _rebuild_handle(actor_id: str, state: str, address: str, node_id: str, incarnation: int,
                    name: str, class_name: str, methods: tuple[str, ...],
                    is_async: bool, max_task_retries: int = 0) -> ActorHandle:
    return ActorHandle(ActorLocation(actor_id, ActorState(state), address, node_id, incarnation,
                                     name, "", class_name, methods, is_async, max_task_retries))


def remote(*args: Any, **options: Any) -> Any:
    """``@pmetal.remote`` or ``@pmetal.remote(num_cpus=..., max_restarts=...)``
    on a function or a class."""
    def wrap(obj: Any) -> Any:
        if inspect.isclass(obj):
            return ActorClass(obj, options)
        if callable(obj):
            return RemoteFunction(obj, options)
        raise PMetalTypeError(f"@pmetal.remote applies to functions and classes, not "
                        f"{type(obj).__name__}")
    if len(args) == 1 and not options and (inspect.isclass(args[0]) or callable(args[0])):
        return wrap(args[0])
    if args:
        raise PMetalTypeError("use @pmetal.remote or @pmetal.remote(option=value, ...)")
    return wrap
