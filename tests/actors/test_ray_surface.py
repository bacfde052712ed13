"""Ray Core's everyday API names beyond the basics, as ``import pmetal as
ray`` scripts use them: ``ray.exceptions``, ``.options(get_if_exists=True)``
and ``ray.get_runtime_context()``. Real actors and tasks on a real node."""

from __future__ import annotations

import importlib

import pytest

import pmetal
import pmetal.exceptions
from pmetal.exceptions import RayActorError

from .actor_classes import Counter
from .conftest import WAIT, wait_until
from .surface_classes import AsyncRuntimeIds, RuntimeIds, runtime_ids_in_a_task

NUM_WORKERS = 2

pytestmark = pytest.mark.usefixtures("cluster")


# ------------------------------------------------------------ ray.exceptions

def test_every_ray_exception_name_is_a_pmetal_error() -> None:
    for name in pmetal.exceptions.__all__:
        cls = getattr(pmetal.exceptions, name)
        assert issubclass(cls, pmetal.PMetalError), name
    assert pmetal.exceptions.RayError is pmetal.PMetalError
    assert pmetal.exceptions.RayActorError is pmetal.ActorDiedError
    assert pmetal.exceptions.RayTaskError is pmetal.RemoteError
    assert issubclass(pmetal.exceptions.GetTimeoutError, TimeoutError)
    assert issubclass(pmetal.exceptions.OwnerDiedError, pmetal.exceptions.ObjectLostError)
    assert issubclass(pmetal.exceptions.WorkerCrashedError, pmetal.ActorDiedError)


def test_ray_import_paths_of_the_exceptions_work_with_an_alias() -> None:
    ray = importlib.import_module("pmetal")
    assert ray.exceptions.ActorDiedError is pmetal.ActorDiedError
    assert importlib.import_module("pmetal.exceptions").GetTimeoutError is pmetal.GetTimeoutError


def test_ray_actor_error_catches_a_call_to_a_killed_actor(reap: list) -> None:
    counter = Counter.remote()
    reap.append(counter)
    assert pmetal.get(counter.inc.remote(), timeout=WAIT) == 1
    pmetal.kill(counter)
    with pytest.raises(RayActorError):
        pmetal.get(counter.inc.remote(), timeout=WAIT)
    try:
        pmetal.get(counter.value.remote(), timeout=WAIT)
    except pmetal.exceptions.RayActorError as exc:
        assert isinstance(exc, pmetal.exceptions.RayError)
    else:
        raise AssertionError("a call to a killed actor returned")


def test_ray_task_error_catches_what_a_task_raised() -> None:
    from .actor_classes import fail
    with pytest.raises(pmetal.exceptions.RayTaskError, match="boom"):
        pmetal.get(fail.remote("boom"), timeout=WAIT)


def test_get_timeout_error_is_rays_name_for_a_get_that_times_out() -> None:
    from .actor_classes import pause
    ref = pause.remote(1.0)
    with pytest.raises(pmetal.exceptions.GetTimeoutError):
        pmetal.get(ref, timeout=0.05)


# ------------------------------------------------------------- get_if_exists

def test_get_if_exists_creates_the_actor_when_absent_and_returns_it_after(
        reap: list) -> None:
    first = Counter.options(name="surface-counter", get_if_exists=True).remote(10)
    reap.append(first)
    assert pmetal.get(first.inc.remote(), timeout=WAIT) == 11
    # The second gets the live actor: its constructor argument is not used.
    second = Counter.options(name="surface-counter", get_if_exists=True).remote(500)
    assert second == first
    assert pmetal.get(second.inc.remote(), timeout=WAIT) == 12
    # Without get_if_exists the name is still refused.
    with pytest.raises(ValueError, match="already exists"):
        Counter.options(name="surface-counter").remote()


def test_get_if_exists_makes_a_new_actor_once_the_named_one_is_dead(reap: list) -> None:
    first = Counter.options(name="surface-phoenix", get_if_exists=True).remote(1)
    reap.append(first)
    pmetal.kill(first)
    # kill returns before the node has marked it dead (in Ray too).
    wait_until(lambda: _is_gone("surface-phoenix"), WAIT, what="the killed actor marked dead")
    again = Counter.options(name="surface-phoenix", get_if_exists=True).remote(7)
    reap.append(again)
    assert again != first
    assert pmetal.get(again.value.remote(), timeout=WAIT) == 7


def test_get_if_exists_without_a_name_is_refused_at_the_call() -> None:
    with pytest.raises(ValueError, match="needs name=") as info:
        Counter.options(get_if_exists=True).remote()
    assert isinstance(info.value, pmetal.PMetalValueError)
    with pytest.raises(TypeError, match="get_if_exists must be True or False"):
        Counter.options(name="x", get_if_exists="yes")


def _is_gone(name: str) -> bool:
    try:
        pmetal.get_actor(name)
    except ValueError:
        return True
    return False


# --------------------------------------------------------- runtime context

def test_runtime_context_in_the_driver(cluster: dict) -> None:
    ctx = pmetal.get_runtime_context()
    assert ctx.get_node_id() == cluster["node_id"] == ctx.node_id
    assert ctx.node_id.hex() == cluster["node_id"]
    job = ctx.get_job_id()
    assert isinstance(job, str) and job and ctx.job_id == job
    assert ctx.get_actor_id() is None and ctx.actor_id is None
    assert ctx.get_task_id() is None
    assert ctx.get() == {"job_id": job, "node_id": cluster["node_id"], "task_id": None,
                         "actor_id": None}
    with pytest.raises(ValueError, match="does not run in an actor"):
        ctx.current_actor  # noqa: B018


def test_runtime_context_in_a_task(cluster: dict) -> None:
    first = pmetal.get(runtime_ids_in_a_task.remote(), timeout=WAIT)
    second = pmetal.get(runtime_ids_in_a_task.remote(), timeout=WAIT)
    assert first["node_id"] == first["node_prop"] == cluster["node_id"]
    assert first["job_id"] == first["job_prop"] == pmetal.get_runtime_context().get_job_id()
    assert first["actor_id"] is None and first["actor_prop"] is None
    assert first["task_id"] and first["task_prop"] == first["task_id"]
    assert second["task_id"] and second["task_id"] != first["task_id"]


def test_runtime_context_in_an_actor(cluster: dict, reap: list) -> None:
    actor = RuntimeIds.remote()
    reap.append(actor)
    first = pmetal.get(actor.ids.remote(), timeout=WAIT)
    second = pmetal.get(actor.ids.remote(), timeout=WAIT)
    assert first["actor_id"] == first["actor_prop"] == actor._actor_id
    assert first["node_id"] == cluster["node_id"]
    assert first["job_id"] == pmetal.get_runtime_context().get_job_id()
    assert first["task_id"] and second["task_id"] != first["task_id"]
    assert pmetal.get(actor.me.remote(), timeout=WAIT) == actor


def test_runtime_context_in_an_async_actor(reap: list) -> None:
    actor = AsyncRuntimeIds.remote()
    reap.append(actor)
    in_coroutine = pmetal.get(actor.ids.remote(), timeout=WAIT)
    in_thread = pmetal.get(actor.plain_ids.remote(), timeout=WAIT)
    for ids in (in_coroutine, in_thread):
        assert ids["actor_id"] == actor._actor_id
        assert ids["task_id"]
    assert in_coroutine["task_id"] != in_thread["task_id"]
