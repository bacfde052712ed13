"""What scripts written for Ray expect: misuse raises a clear error at the
call (C10, D18), ``max_concurrency=N`` runs N calls at once (D16), any user
exception type arrives catchable with its attributes (D17), and the retry
options of tasks and actors (D18)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal import (ActorDiedError, PlacementError, PMetalError, PMetalTypeError,
                    PMetalValueError, RemoteError)
from pmetal.hardware import gpu_count

from .actor_classes import Counter, square
from .conftest import WAIT
from .semantics_classes import (AppError, AsyncMeeting, Fragile, HoldsALockError,
                                KeywordOnlyError, Meeting, Raiser, exit_the_first_time,
                                fail_times, raise_app_error, raise_holding_a_lock)

NUM_WORKERS = 3

pytestmark = pytest.mark.usefixtures("cluster")

PROMPT = 2.0
"""A misuse error arrives within this (the old get_actor(123) took 30 s)."""


# ------------------------------------------------------------------- misuse

@pytest.mark.parametrize("call, builtin, match", [
    (lambda: pmetal.get_actor(123), TypeError, "actor name .a str., not int"),
    (lambda: pmetal.get_actor(""), ValueError, "non-empty name"),
    (lambda: pmetal.get_actor("nobody-has-this-name"), ValueError, "nobody-has-this-name"),
    (lambda: pmetal.kill("counter"), TypeError, "actor handle, not str"),
    (lambda: pmetal.get(5), TypeError, "not int"),
    (lambda: pmetal.get("ref"), TypeError, "not str"),
    (lambda: pmetal.get([5]), TypeError, "holds a int"),
    (lambda: pmetal.wait(pmetal.put(1)), TypeError, r"pmetal.wait\(\[ref\]\)"),
    (lambda: pmetal.wait([pmetal.put(1)], num_returns="1"), TypeError, "num_returns"),
    (lambda: pmetal.put(pmetal.put(1)), TypeError, "ObjectRef"),
    (lambda: pmetal.get(pmetal.put(1), timeout="5"), TypeError, "timeout must be a number"),
    (lambda: pmetal.wait([pmetal.put(1)], timeout=-1), ValueError, "timeout=-1"),
    (lambda: pmetal.init(ignore_reinit_error=True, resources={"CPU": "lots"}), TypeError,
     "'CPU' must be a number, not str 'lots'"),
    (lambda: pmetal.init(ignore_reinit_error=True, resources={"GPU": -1}), ValueError,
     "'GPU' must not be negative"),
    (lambda: pmetal.init(ignore_reinit_error=True, num_workers=-2), ValueError,
     "num_workers"),
], ids=["get_actor-int", "get_actor-empty", "get_actor-unknown", "kill-str", "get-int",
        "get-str", "get-list-of-int", "wait-one-ref", "wait-num_returns-str", "put-ref",
        "get-timeout-str", "wait-timeout-negative", "init-resource-str",
        "init-resource-negative", "init-num_workers-negative"])
def test_misuse_raises_at_the_call_as_builtin_and_pmetal_error(
        call: Any, builtin: type[Exception], match: str) -> None:
    start = time.monotonic()
    with pytest.raises(builtin, match=match) as info:
        call()
    assert isinstance(info.value, PMetalError)
    assert isinstance(info.value, PMetalTypeError if builtin is TypeError else PMetalValueError)
    assert time.monotonic() - start < PROMPT


@pytest.mark.parametrize("make, builtin, match", [
    (lambda: Counter.options(num_gpu=1), TypeError, r"\['num_gpu'\]; valid: .*'num_gpus'"),
    (lambda: Counter.options(max_retries=2), TypeError, "only for remote functions"),
    (lambda: square.options(max_restarts=2), TypeError, "only for actors"),
    (lambda: square.options(max_concurrency=2), TypeError, "only for actors"),
    (lambda: Counter.options(num_cpus="lots"), TypeError, "num_cpus must be a number"),
    (lambda: Counter.options(num_gpus=-1), ValueError, "num_gpus=-1"),
    (lambda: Counter.options(max_concurrency=0), ValueError, "max_concurrency=0"),
    (lambda: Counter.options(max_restarts=1.5), TypeError, "max_restarts must be an int"),
    (lambda: Counter.options(resources={"GPU": -1}), ValueError, "non-negative"),
    (lambda: Counter.options(name=7), TypeError, "name must be a str"),
    (lambda: square.options(retry_exceptions=ValueError), TypeError, "retry_exceptions"),
    (lambda: square.options(retry_exceptions=[ValueError, "KeyError"]), TypeError,
     "retry_exceptions"),
], ids=["typo", "function-option-on-actor", "actor-option-on-function", "max_concurrency-fn",
        "num_cpus-str", "num_gpus-negative", "max_concurrency-0", "max_restarts-float",
        "resource-negative", "name-int", "retry_exceptions-class", "retry_exceptions-str"])
def test_bad_options_are_refused_when_given(make: Any, builtin: type[Exception],
                                            match: str) -> None:
    with pytest.raises(builtin, match=match) as info:
        make()
    assert isinstance(info.value, PMetalError)


def test_valid_ray_options_are_accepted() -> None:
    Counter.options(num_cpus=0, num_gpus=0, max_restarts=-1, max_task_retries=-1,
                    max_concurrency=4, name="x", lifetime=None, namespace=None)
    square.options(num_cpus=1, num_gpus=0, max_retries=-1, retry_exceptions=True)
    square.options(max_retries=0, retry_exceptions=[ValueError, KeyError])


# ---------------------------------------------------------------- max_concurrency

@pytest.mark.parametrize("actor_class", [Meeting, AsyncMeeting], ids=["threads", "async"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_max_concurrency_runs_exactly_n_calls_at_once(actor_class: Any, n: int,
                                                      reap: list[Any]) -> None:
    actor = actor_class.options(max_concurrency=n).remote(n)
    reap.append(actor)
    # n + 1 calls sent together (the later ones travel as one CallBatch): the
    # first n can only return once all n run at once; the last runs after.
    refs = [actor.meet.remote(i) for i in range(n + 1)]
    assert pmetal.get(refs, timeout=WAIT + 5) == list(range(n + 1))
    assert pmetal.get(actor.peak_seen.remote(), timeout=WAIT) == n


# ------------------------------------------------------------ user exceptions

def _check_app_error(err: BaseException) -> None:
    assert isinstance(err, RemoteError) and isinstance(err, AppError)
    assert (err.code, err.text) == (7, "seven")
    assert err.args == ("[7] seven",)
    assert "AppError" in err.remote_traceback
    cause = err.cause
    assert type(cause) is AppError
    assert (cause.code, cause.text, cause.args) == (7, "seven", ("[7] seven",))


def test_an_exception_whose_init_takes_other_arguments_is_caught_by_its_class(
        reap: list[Any]) -> None:
    raiser = Raiser.remote()
    reap.append(raiser)
    with pytest.raises(AppError) as info:
        pmetal.get(raiser.app.remote(7, "seven"), timeout=WAIT)
    _check_app_error(info.value)
    with pytest.raises(AppError) as info:
        pmetal.get(raise_app_error.remote(7, "seven"), timeout=WAIT)
    _check_app_error(info.value)
    # Raised in a task, let through by the actor that waited for it: still AppError.
    with pytest.raises(AppError) as info:
        pmetal.get(raiser.through_a_task.remote(7, "seven"), timeout=WAIT)
    _check_app_error(info.value)
    with pytest.raises(KeywordOnlyError) as kw_info:
        pmetal.get(raiser.keyword_only.remote("why not"), timeout=WAIT)
    assert kw_info.value.reason == "why not"
    assert isinstance(kw_info.value, RemoteError)


def test_an_exception_with_an_unpicklable_attribute_keeps_its_class_and_args() -> None:
    with pytest.raises(HoldsALockError) as info:
        pmetal.get(raise_holding_a_lock.remote("locked"), timeout=WAIT)
    assert info.value.args == ("locked",)
    assert "lock" not in vars(info.value)   # what could not travel stays behind
    assert isinstance(info.value, RemoteError)


def test_an_exception_class_defined_in_the_test_travels_by_value() -> None:
    class Local(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a + b)
            self.parts = (a, b)

    @pmetal.remote
    def boom(a: int, b: int) -> None:
        raise Local(a, b)

    # cloudpickle maps the class back to this very one on its way home.
    with pytest.raises(Local) as info:
        pmetal.get(boom.remote(2, 3), timeout=WAIT)
    err = info.value
    assert isinstance(err, RemoteError)
    assert err.parts == (2, 3) and err.args == (5,)


# ------------------------------------------------------------------- GPUs

def test_gpus_are_counted_as_ray_counts_them(tmp_path: Path) -> None:
    assert gpu_count(str(tmp_path), system="Darwin", machine="arm64") == 1
    assert gpu_count(str(tmp_path), system="Darwin", machine="x86_64") == 0
    assert gpu_count(str(tmp_path), system="Linux", machine="x86_64") == 0
    gpus = tmp_path / "driver" / "nvidia" / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (gpus / bus).mkdir(parents=True)
    assert gpu_count(str(tmp_path), system="Linux", machine="x86_64") == 2


def test_the_node_reports_its_gpus_and_num_gpus_is_placed_against_them(
        reap: list[Any]) -> None:
    gpus = gpu_count()
    assert pmetal.cluster_resources().get("GPU", 0.0) == gpus
    if gpus:
        actor = Counter.options(num_gpus=1).remote()
        reap.append(actor)
        assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1
        return
    start = time.monotonic()
    with pytest.raises(PlacementError, match="GPU"):
        Counter.options(num_gpus=1).remote()
    with pytest.raises(PlacementError, match="GPU"):   # a task's error shows at get
        pmetal.get(square.options(num_gpus=1).remote(2))
    assert time.monotonic() - start < PROMPT


# ----------------------------------------------------------------- retries

def test_a_task_whose_worker_dies_is_retried_by_default(tmp_path: Path) -> None:
    ref = exit_the_first_time.remote(str(tmp_path / "marker"))
    assert pmetal.get(ref, timeout=WAIT + 10) == "ran again"


def test_wait_sees_a_retried_task_as_pending_until_its_rerun_is_done(tmp_path: Path) -> None:
    ref = exit_the_first_time.remote(str(tmp_path / "marker"))
    ready, pending = pmetal.wait([ref], timeout=WAIT + 10)
    assert (ready, pending) == ([ref], [])
    assert pmetal.get(ref, timeout=0) == "ran again"


def test_max_retries_zero_fails_a_task_whose_worker_dies(tmp_path: Path) -> None:
    ref = exit_the_first_time.options(max_retries=0).remote(str(tmp_path / "marker"))
    with pytest.raises(ActorDiedError):
        pmetal.get(ref, timeout=WAIT)


def test_retry_exceptions_lists_the_exceptions_that_retry(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    retried = fail_times.options(max_retries=2, retry_exceptions=[ValueError])
    assert pmetal.get(retried.remote(str(counter), 2, "ValueError"), timeout=WAIT) == 3
    assert counter.read_text() == "3"
    # Out of retries: the last error stands.
    counter.unlink()
    with pytest.raises(ValueError, match="run 3"):
        pmetal.get(retried.remote(str(counter), 5, "ValueError"), timeout=WAIT)
    assert counter.read_text() == "3"
    # Not listed: no retry.
    counter.unlink()
    with pytest.raises(KeyError, match="run 1"):
        pmetal.get(retried.remote(str(counter), 1, "KeyError"), timeout=WAIT)
    assert counter.read_text() == "1"


def test_retry_exceptions_true_retries_any_and_the_default_none(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    any_error = fail_times.options(max_retries=1, retry_exceptions=True)
    assert pmetal.get(any_error.remote(str(counter), 1, "KeyError"), timeout=WAIT) == 2
    counter.unlink()
    with pytest.raises(ValueError, match="run 1"):
        pmetal.get(fail_times.remote(str(counter), 1, "ValueError"), timeout=WAIT)
    assert counter.read_text() == "1"


def test_max_task_retries_resends_a_call_to_the_restarted_actor(tmp_path: Path,
                                                                reap: list[Any]) -> None:
    actor = Fragile.options(max_restarts=1, max_task_retries=1).remote()
    reap.append(actor)
    first_pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
    new_pid = pmetal.get(actor.exit_the_first_time.remote(str(tmp_path / "m")),
                         timeout=WAIT + 10)
    assert new_pid != first_pid
    assert pmetal.get(actor.pid.remote(), timeout=WAIT) == new_pid


def test_without_max_task_retries_a_call_fails_when_its_actor_dies(tmp_path: Path,
                                                                   reap: list[Any]) -> None:
    actor = Fragile.options(max_restarts=1).remote()
    reap.append(actor)
    with pytest.raises(ActorDiedError):
        pmetal.get(actor.exit_the_first_time.remote(str(tmp_path / "m")), timeout=WAIT)


def test_a_handle_from_get_actor_retries_as_the_creators_does(tmp_path: Path,
                                                              reap: list[Any]) -> None:
    # The node keeps max_task_retries with the actor: however the handle was
    # obtained, a call in flight when the actor dies goes to its next incarnation.
    created = Fragile.options(name="fragile-by-name", max_restarts=1,
                              max_task_retries=1).remote()
    reap.append(created)
    first_pid = pmetal.get(created.pid.remote(), timeout=WAIT)
    found = pmetal.get_actor("fragile-by-name")
    assert found._max_task_retries == 1
    new_pid = pmetal.get(found.exit_the_first_time.remote(str(tmp_path / "m")),
                         timeout=WAIT + 10)
    assert new_pid != first_pid
    assert pmetal.get(found.pid.remote(), timeout=WAIT) == new_pid
