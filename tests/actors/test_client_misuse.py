"""A new user's misuse gets a specific error at once, and nothing is left
running: settings given to ``pmetal.init`` are all kept, a call after
``pmetal.shutdown()`` says so, a call to an actor whose creator died says
that it died."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import pmetal
from pmetal import api
from pmetal.config import load_config

from .conftest import shutdown_quietly


def _node_config(pid: int) -> object:
    """The config the node process ``pid`` loads from its environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().partition("=")[::2] for item in raw if item)
    return load_config(env=env)


def test_init_with_config_and_namespace_keeps_every_setting() -> None:
    if pmetal.is_initialized():
        shutdown_quietly()
    # One non-default value in every section.
    cfg = load_config(env={}, transport={"request_timeout": 7.5},
                      actors={"owner_lease": 12.0},
                      health={"dead_after": 1.7, "suspect_after": 1.1},
                      election={"timeout": 1.3}, discovery={"interfaces": "127.0.0.9"},
                      collectives={"timeout": 11.0, "strategy": "ring"},
                      security={"bulk_auth": False})
    want = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security,
                                                                 namespace="misuse-ns"))
    pmetal.init(config=cfg, namespace="misuse-ns")
    try:
        client = api.client()
        assert client.config == want
        assert client.status()["namespace"] == "misuse-ns"
        # The embedded node runs with the same settings.
        node = _node_config(client.status()["pid"])
        for section in ("transport", "actors", "health", "election", "collectives"):
            assert getattr(node, section) == getattr(want, section), section
        assert node.security.bulk_auth is False
    finally:
        shutdown_quietly()
