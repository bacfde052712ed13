"""Ray's ``runtime_env``, the part pmetal has: ``{"env_vars": {...},
"working_dir": path, "excludes": [...]}``.

``pmetal.init(runtime_env=...)`` sets the job's environment variables (every
task and actor this driver starts gets them); ``.options(runtime_env=...)``
adds to them for one remote function or actor class (its values win, as
Ray merges ``env_vars``). An actor's variables are set in its worker before
the constructor runs and stay for its life; a task's are set for that call
only and the worker's own are restored after it (a task worker runs one
call at a time). ``working_dir`` (with ``excludes``) ships a folder to the
machines that run the work (:mod:`pmetal.actors.workdir`); one given to
``.options`` replaces the job's. Every other key Ray knows (``pip``,
``conda``, ``py_modules``, ...) is refused by name: pmetal does not install
packages.

``worker_process_setup_hook`` (a function, or ``"module.function"``), given
to ``pmetal.init(runtime_env=...)`` as in Ray, runs once in every worker
process before the first task or actor of the job runs there (Ray runs it
when the worker starts; pmetal's workers are started before any job, so it
runs at the first work instead). A hook that raises fails that task or actor
with :class:`~pmetal.errors.RuntimeEnvSetupError`, and runs again at the
next one.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

from pmetal.errors import PMetalTypeError, PMetalValueError, RuntimeEnvSetupError

__all__ = ["SETUP_HOOK", "call_with_env", "call_with_setup_hook", "check_runtime_env",
           "job_env_vars", "job_setup_hook", "job_working_dir", "merged_env_vars",
           "run_setup_hook", "set_job_env_vars", "set_job_setup_hook", "set_job_working_dir",
           "setup_hook_spec", "stream_with_env", "working_dir_spec"]

SETUP_HOOK = "worker_process_setup_hook"
_KEYS = ("env_vars", "working_dir", "excludes", SETUP_HOOK)

_job_setup_hook: tuple[str, Any] | None = None   # (code id, CodeRef), from pmetal.init
_hooks_run: set[str] = set()   # the hooks this process ran (code ids)

_job_env_vars: dict[str, str] = {}   # this driver's, from pmetal.init(runtime_env=...)
_job_working_dir: dict[str, Any] | None = None   # ... its working_dir, packed


def check_runtime_env(runtime_env: Any, where: str) -> dict[str, str]:
    """The ``env_vars`` of ``runtime_env`` (a dict, or None for none), its
    ``working_dir`` checked too (packed, when a path: a folder that does not
    exist or is too big is refused here); PMetalTypeError/PMetalValueError
    saying what is wrong otherwise."""
    if runtime_env is None:
        return {}
    if not isinstance(runtime_env, dict):
        raise PMetalTypeError(f"{where}: runtime_env must be a dict like "
                              f"{{'env_vars': {{'NAME': 'value'}}, 'working_dir': 'path'}}, "
                              f"not {type(runtime_env).__name__}")
    other = sorted(str(k) for k in runtime_env if k not in _KEYS)
    if other:
        named = ", ".join(repr(k) for k in other)
        raise PMetalValueError(f"{where}: runtime_env key(s) {named} not supported; pmetal "
                               f"supports {', '.join(map(repr, _KEYS))} (install packages on "
                               f"every node yourself)")
    working_dir_spec(runtime_env, where)
    hook = runtime_env.get(SETUP_HOOK)
    if hook is not None and not callable(hook) and not isinstance(hook, str) and not (
            isinstance(hook, (list, tuple)) and len(hook) == 2):   # (id, CodeRef): the wire's
        raise PMetalTypeError(f"{where}: runtime_env[{SETUP_HOOK!r}] must be a function or "
                              f"'module.function', not {type(hook).__name__}")
    env_vars = runtime_env.get("env_vars") or {}
    if not isinstance(env_vars, dict):
        raise PMetalTypeError(f"{where}: runtime_env['env_vars'] must be a dict of str to "
                              f"str, not {type(env_vars).__name__}")
    for name, value in env_vars.items():
        if type(name) is not str or not name or "=" in name or "\0" in name:
            raise PMetalValueError(f"{where}: runtime_env['env_vars'] has a bad variable "
                                   f"name {name!r:.40} (a non-empty str without '=')")
        if type(value) is not str:
            raise PMetalTypeError(f"{where}: runtime_env['env_vars'][{name!r}] must be a "
                                  f"str, not {type(value).__name__} {value!r:.40} (as in "
                                  f"Ray: write str({value!r:.20}))")
        if "\0" in value:
            raise PMetalValueError(f"{where}: runtime_env['env_vars'][{name!r}] holds a "
                                   f"NUL character")
    return dict(env_vars)


def working_dir_spec(runtime_env: Any, where: str) -> dict[str, Any] | None:
    """``runtime_env``'s working_dir as it travels (``sha256``, ``digest``,
    ...: see pmetal.actors.workdir), packing a path given by the user;
    None when it has none."""
    if not runtime_env:
        return None
    folder = runtime_env.get("working_dir")
    if folder is None:
        if runtime_env.get("excludes") is not None:
            raise PMetalValueError(f"{where}: runtime_env['excludes'] applies to a "
                                   f"working_dir; give runtime_env['working_dir'] too")
        return None
    from pmetal.actors import workdir
    if isinstance(folder, dict):   # packed already: a spec from the wire
        workdir.check_spec(folder, where)
        return folder
    return workdir.publish(folder, runtime_env.get("excludes"), where)


def setup_hook_spec(runtime_env: Any, where: str) -> tuple[str, Any] | None:
    """``runtime_env``'s worker_process_setup_hook as it travels: (code id,
    CodeRef); None when it has none (check_runtime_env checked its type)."""
    hook = (runtime_env or {}).get(SETUP_HOOK)
    if hook is None:
        return None
    from pmetal.actors.serialization import code_ref
    if isinstance(hook, str):
        module, dot, name = hook.rpartition(".")
        if not dot or not module or not name:
            raise PMetalValueError(f"{where}: runtime_env[{SETUP_HOOK!r}]={hook!r}: a string "
                                   f"names a function as 'module.function'")
        return f"{module}:{name}", f"{module}:{name}"
    return code_ref(hook)


def set_job_setup_hook(spec: tuple[str, Any] | None) -> None:
    global _job_setup_hook
    _job_setup_hook = spec


def job_setup_hook() -> tuple[str, Any] | None:
    return _job_setup_hook


def run_setup_hook(spec: Any) -> None:
    """Run the hook of ``spec`` (code id, CodeRef) unless this process ran
    it already; RuntimeEnvSetupError when it cannot be loaded or raises."""
    hook_id, ref = spec
    if hook_id in _hooks_run:
        return
    from pmetal.actors.serialization import load_code
    try:
        load_code(ref)()
    except Exception as exc:
        raise RuntimeEnvSetupError(f"runtime_env {SETUP_HOOK} {hook_id}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    _hooks_run.add(hook_id)


def call_with_setup_hook(spec: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` after the job's setup hook ran in this process."""
    run_setup_hook(spec)
    return fn(*args, **kwargs)


def set_job_working_dir(spec: dict[str, Any] | None) -> None:
    global _job_working_dir
    _job_working_dir = spec


def job_working_dir() -> dict[str, Any] | None:
    return _job_working_dir


def set_job_env_vars(env_vars: dict[str, str]) -> None:
    global _job_env_vars
    _job_env_vars = dict(env_vars)


def job_env_vars() -> dict[str, str]:
    return dict(_job_env_vars)


def merged_env_vars(options: dict[str, Any], where: str) -> dict[str, str]:
    """The job's variables with those of ``options["runtime_env"]`` over them."""
    return {**_job_env_vars, **check_runtime_env(options.get("runtime_env"), where)}


def set_env(env_vars: dict[str, str]) -> dict[str, str | None]:
    """Set ``env_vars`` in this process; returns what they replaced (None: unset)."""
    before = {name: os.environ.get(name) for name in env_vars}
    os.environ.update(env_vars)
    return before


def restore_env(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def call_with_env(env_vars: dict[str, str], fn: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``env_vars`` set, the previous values back after."""
    before = set_env(env_vars)
    try:
        return fn(*args, **kwargs)
    finally:
        restore_env(before)


def stream_with_env(env_vars: dict[str, str], fn: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Any:
    """``call_with_env`` for a generator function (``num_returns="streaming"``):
    the variables are set while the generator runs, up to its end or close
    (a task worker serves one stream at a time)."""
    made = fn(*args, **kwargs)
    if inspect.isasyncgen(made):
        return _async_stream_with_env(env_vars, made)
    if not isinstance(made, Iterator):
        return made   # not a generator: the worker says so
    return _stream_with_env(env_vars, made)


def _stream_with_env(env_vars: dict[str, str], made: Any) -> Any:
    before = set_env(env_vars)
    try:
        yield from made
    finally:
        restore_env(before)


async def _async_stream_with_env(env_vars: dict[str, str], made: Any) -> Any:
    before = set_env(env_vars)
    try:
        async for item in made:
            yield item
    finally:
        restore_env(before)
