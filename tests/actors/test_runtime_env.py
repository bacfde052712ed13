"""``runtime_env={"env_vars": {...}}`` as in Ray, in ``pmetal.init`` and in
``.options``: the variables are set in the worker before user code runs
(an actor's before its constructor, a task's for its call only). Every
other runtime_env key is refused by name. Real node and worker processes
on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import pmetal

from .conftest import WAIT, shutdown_quietly

JOB_ENV = {"PMETAL_TEST_JOB": "job", "PMETAL_TEST_BOTH": "job"}


@pmetal.remote
def read_env(*names: str) -> list[str | None]:
    return [os.environ.get(n) for n in names]


@pmetal.remote
class EnvActor:
    def __init__(self) -> None:
        self.at_construction = os.environ.get("PMETAL_TEST_ACTOR")

    def seen(self) -> tuple[str | None, str | None, str | None]:
        return (self.at_construction, os.environ.get("PMETAL_TEST_ACTOR"),
                os.environ.get("PMETAL_TEST_JOB"))


@pytest.fixture(scope="module")
def job() -> Iterator[dict[str, Any]]:
    if pmetal.is_initialized():
        shutdown_quietly()
    info = pmetal.init(num_workers=1, runtime_env={"env_vars": JOB_ENV})
    try:
        yield info
    finally:
        shutdown_quietly()


def test_tasks_see_the_jobs_variables_and_their_own_over_them(job: dict[str, Any]) -> None:
    names = ("PMETAL_TEST_JOB", "PMETAL_TEST_BOTH", "PMETAL_TEST_TASK")
    assert pmetal.get(read_env.remote(*names), timeout=WAIT) == ["job", "job", None]
    own = read_env.options(runtime_env={"env_vars": {"PMETAL_TEST_BOTH": "task",
                                                     "PMETAL_TEST_TASK": "1"}})
    assert pmetal.get(own.remote(*names), timeout=WAIT) == ["job", "task", "1"]
    # Set for that call only: the worker's own environment is back after it.
    later = pmetal.get([read_env.remote(*names) for _ in range(4)], timeout=WAIT)
    assert later == [["job", "job", None]] * 4


def test_an_actor_has_its_variables_before_its_constructor(job: dict[str, Any]) -> None:
    actor = EnvActor.options(runtime_env={"env_vars": {"PMETAL_TEST_ACTOR": "a"}}).remote()
    try:
        assert pmetal.get(actor.seen.remote(), timeout=WAIT) == ("a", "a", "job")
    finally:
        pmetal.kill(actor)


@pytest.mark.parametrize("runtime_env, error, words", [
    ({"working_dir": 3}, TypeError, r"runtime_env\['working_dir'\] must be the path"),
    ({"excludes": ["*.log"]}, ValueError, r"give runtime_env\['working_dir'\] too"),
    ({"pip": ["requests"], "env_vars": {}}, ValueError, "'pip' not supported"),
    ({"conda": "env", "py_modules": []}, ValueError, "'conda', 'py_modules' not supported"),
    ({"env_vars": {"N": 1}}, TypeError, r"\['N'\] must be a str, not int"),
    ({"env_vars": ["N=1"]}, TypeError, "must be a dict of str to str, not list"),
    ({"env_vars": {"A=B": "1"}}, ValueError, "bad variable name"),
    ("env_vars", TypeError, "runtime_env must be a dict"),
])
def test_what_pmetal_cannot_do_is_refused_by_name(runtime_env: Any, error: type,
                                                  words: str) -> None:
    for make in (lambda: EnvActor.options(runtime_env=runtime_env),
                 lambda: read_env.options(runtime_env=runtime_env),
                 lambda: pmetal.init(runtime_env=runtime_env)):
        with pytest.raises(error, match=words) as info:
            make()
        assert isinstance(info.value, pmetal.PMetalError)


def test_a_node_refuses_a_creation_with_a_bad_runtime_env_from_any_peer() -> None:
    from pmetal.node.placement import check_options
    check_options({"runtime_env": {"env_vars": {"A": "1"}}})
    with pytest.raises(TypeError, match="must be a str"):
        check_options({"runtime_env": {"env_vars": {"A": 1}}})
    with pytest.raises(ValueError, match="'pip' not supported"):
        check_options({"runtime_env": {"pip": []}})
