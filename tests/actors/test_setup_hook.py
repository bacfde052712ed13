"""Ray's ``runtime_env={"worker_process_setup_hook": fn}`` on
``pmetal.init``: ``fn`` runs once in each worker process before the job's
first task or actor there; and an actor's ``__ray_ready__``. Real node and
worker processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import pmetal
from pmetal.errors import PMetalTypeError, PMetalValueError, RuntimeEnvSetupError

from .conftest import WAIT, shutdown_quietly
from . import hook_classes
from .hook_classes import Host, record_run, runs_here


@pytest.fixture
def fresh() -> Iterator[None]:
    if pmetal.is_initialized():
        shutdown_quietly()
    yield
    shutdown_quietly()


def test_the_hook_runs_once_per_worker_before_tasks_and_actors(fresh: None) -> None:
    pmetal.init(num_workers=2, runtime_env={"worker_process_setup_hook": record_run,
                                            "env_vars": {"HOOK_TAG": "job"}})
    seen = pmetal.get([runs_here.remote() for _ in range(6)], timeout=WAIT)
    assert {tuple(runs) for _, runs in seen} == {("job",)}   # once in each, env set first
    actor = Host.remote()
    assert pmetal.get(actor.__ray_ready__.remote(), timeout=WAIT) is True
    pid, runs = pmetal.get(actor.runs_here.remote(), timeout=WAIT)
    assert runs == ["job"] and pid not in {p for p, _ in seen}
    pmetal.kill(actor)


def test_a_hook_named_by_string_and_one_that_fails(fresh: None) -> None:
    pmetal.init(num_workers=1, runtime_env={
        "worker_process_setup_hook": f"{hook_classes.__name__}.record_run"})
    assert pmetal.get(runs_here.remote(), timeout=WAIT)[1] == ["no tag"]
    shutdown_quietly()
    pmetal.init(num_workers=1, runtime_env={
        "worker_process_setup_hook": f"{hook_classes.__name__}.broken"})
    with pytest.raises(RuntimeEnvSetupError, match="the log folder is missing"):
        pmetal.get(runs_here.remote(), timeout=WAIT)
    with pytest.raises(RuntimeEnvSetupError, match="the log folder is missing"):
        Host.remote()


def test_misuse_is_refused_by_name(fresh: None) -> None:
    with pytest.raises(PMetalTypeError, match="worker_process_setup_hook.*must be a function"):
        pmetal.init(runtime_env={"worker_process_setup_hook": 3})
    with pytest.raises(PMetalValueError, match="'module.function'"):
        pmetal.init(runtime_env={"worker_process_setup_hook": "nodot"})
    with pytest.raises(PMetalValueError, match="give it to pmetal.init"):
        runs_here.options(runtime_env={"worker_process_setup_hook": record_run})
