"""Configuration: defaults, PMETAL_* overrides, keyword overrides, validation.

Every call passes an explicit ``env`` so the developer's real environment
cannot leak into a test."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from pmetal.config import (
    DEFAULT_PORT,
    PMetalConfig,
    SecurityConfig,
    TransportConfig,
    config_as_dict,
    config_env,
    load_config,
    pmetal_home,
)
from pmetal.errors import ConfigError


def test_defaults() -> None:
    cfg = load_config(env={})
    assert cfg == PMetalConfig()
    assert cfg.transport == TransportConfig()
    assert cfg.security == SecurityConfig()
    assert cfg.transport.port == DEFAULT_PORT
    assert cfg.transport.host == "127.0.0.1"
    assert cfg.transport.chunk_bytes == 1 << 20
    assert cfg.transport.max_message_bytes == 2048 << 20
    assert cfg.security.namespace == "default"
    assert cfg.security.bulk_auth is True
    assert cfg.security.encrypt is False


def test_env_overrides_each_type() -> None:
    cfg = load_config(env={
        "PMETAL_TRANSPORT_PORT": "6000",
        "PMETAL_TRANSPORT_HOST": "0.0.0.0",
        "PMETAL_TRANSPORT_REQUEST_TIMEOUT": "0.25",
        "PMETAL_SECURITY_ENCRYPT": "true",
        "PMETAL_SECURITY_NAMESPACE": "lab",
    })
    assert cfg.transport.port == 6000
    assert cfg.transport.host == "0.0.0.0"
    assert cfg.transport.request_timeout == 0.25
    assert cfg.security.encrypt is True
    assert cfg.security.namespace == "lab"
    assert cfg.transport.send_timeout == TransportConfig().send_timeout


@pytest.mark.parametrize("raw, value", [("6000", 6000), (" 6000 ", 6000), ("0x1770", 6000),
                                        ("0o13560", 6000), ("6_000", 6000)])
def test_env_int_forms(raw: str, value: int) -> None:
    cfg = load_config(env={"PMETAL_TRANSPORT_PORT": raw})
    assert cfg.transport.port == value
    assert type(cfg.transport.port) is int


@pytest.mark.parametrize("raw, value", [("2", 2.0), ("0.5", 0.5), ("1e-3", 0.001),
                                        (" 3.5 ", 3.5), ("inf", float("inf"))])
def test_env_float_forms(raw: str, value: float) -> None:
    cfg = load_config(env={"PMETAL_TRANSPORT_CONNECT_TIMEOUT": raw})
    assert cfg.transport.connect_timeout == value
    assert type(cfg.transport.connect_timeout) is float


@pytest.mark.parametrize("raw", ["1", "true", "True", "YES", "on", " on "])
def test_env_true_forms(raw: str) -> None:
    assert load_config(env={"PMETAL_SECURITY_ENCRYPT": raw}).security.encrypt is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_env_false_forms(raw: str) -> None:
    assert load_config(env={"PMETAL_SECURITY_BULK_AUTH": raw}).security.bulk_auth is False


@pytest.mark.parametrize("key, raw", [
    ("PMETAL_TRANSPORT_PORT", "six thousand"),
    ("PMETAL_TRANSPORT_PORT", "6000.0"),
    ("PMETAL_TRANSPORT_PORT", ""),
    ("PMETAL_TRANSPORT_SEND_TIMEOUT", "fast"),
    ("PMETAL_SECURITY_ENCRYPT", "maybe"),
    ("PMETAL_SECURITY_ENCRYPT", "2"),
])
def test_unreadable_env_value_names_the_setting(key: str, raw: str) -> None:
    section, name = key.removeprefix("PMETAL_").lower().split("_", 1)
    with pytest.raises(ConfigError, match=rf"{section}\.{name}: cannot read"):
        load_config(env={key: raw})


def test_keyword_overrides() -> None:
    cfg = load_config(env={}, transport={"port": 7000, "request_timeout": 0.5},
                      security={"namespace": "lab", "encrypt": True})
    assert (cfg.transport.port, cfg.transport.request_timeout) == (7000, 0.5)
    assert (cfg.security.namespace, cfg.security.encrypt) == ("lab", True)


def test_keyword_overrides_win_over_env() -> None:
    cfg = load_config(env={"PMETAL_TRANSPORT_PORT": "6000", "PMETAL_TRANSPORT_HOST": "10.0.0.1"},
                      transport={"port": 7000})
    assert cfg.transport.port == 7000
    assert cfg.transport.host == "10.0.0.1"


def test_keyword_values_are_coerced_like_env_values() -> None:
    cfg = load_config(env={}, transport={"port": "6000", "send_timeout": 2},
                      security={"encrypt": "yes"})
    assert cfg.transport.port == 6000
    assert cfg.transport.send_timeout == 2.0 and type(cfg.transport.send_timeout) is float
    assert cfg.security.encrypt is True


@pytest.mark.parametrize("section, overrides, why", [
    ("transport", {"port": True}, "expected int"),
    ("transport", {"port": 6000.0}, "expected int"),
    ("transport", {"send_timeout": False}, "expected float"),
    ("transport", {"host": 127}, "expected str"),
    ("security", {"encrypt": 1}, "expected bool"),
])
def test_keyword_values_of_the_wrong_type_are_rejected(section: str, overrides: dict[str, Any],
                                                       why: str) -> None:
    (name,) = overrides
    with pytest.raises(ConfigError, match=rf"{section}\.{name}: {why}"):
        load_config(env={}, **{section: overrides})


@pytest.mark.parametrize("key", ["PMETAL_TRANSPORT_PROT", "PMETAL_TRANSPORTS_PORT", "PMETAL_PORT",
                                 "PMETAL_", "PMETAL_NOPE_X", "PMETAL_SECURITY_"])
def test_unknown_env_var_is_rejected_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown environment variable {key};") as info:
        load_config(env={key: "1"})
    assert isinstance(info.value, ValueError)
    assert "PMETAL_TRANSPORT_PORT" in str(info.value)  # the message lists what is known


def test_unknown_section_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match="unknown config section 'transprot'") as info:
        load_config(env={}, transprot={"port": 1})
    assert isinstance(info.value, ValueError)


def test_unknown_field_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting transport\.prot") as info:
        load_config(env={}, transport={"prot": 1})
    assert isinstance(info.value, ValueError)


def test_variables_of_other_programs_are_ignored() -> None:
    cfg = load_config(env={"PATH": "/bin", "HOME": "/root", "pmetal_transport_port": "1",
                           "XPMETAL_TRANSPORT_PORT": "1"})
    assert cfg == PMetalConfig()


@pytest.mark.parametrize("key", ["PMETAL_HOME", "PMETAL_PSK", "PMETAL_LOG_LEVEL",
                                 "PMETAL_RANK", "PMETAL_WORLD_SIZE", "PMETAL_LOCAL_RANK",
                                 "PMETAL_NODES"])
def test_standalone_variables_are_not_sections(key: str) -> None:
    assert load_config(env={key: "/some/value"}) == PMetalConfig()


@pytest.mark.parametrize("section, overrides, bad", [
    ("transport", {"port": 70000}, "transport.port"),
    ("transport", {"port": 65536}, "transport.port"),
    ("transport", {"port": -1}, "transport.port"),
    ("transport", {"request_timeout": -1.0}, "transport.request_timeout"),
    ("transport", {"connect_timeout": 0}, "transport.connect_timeout"),
    ("transport", {"send_timeout": float("nan")}, "transport.send_timeout"),
    ("transport", {"reconnect_ivl": -0.1}, "transport.reconnect_ivl"),
    ("transport", {"chunk_bytes": 0}, "transport.chunk_bytes"),
    ("transport", {"max_sessions": -5}, "transport.max_sessions"),
    ("transport", {"max_message_bytes": 1024, "chunk_bytes": 2048}, "transport.chunk_bytes"),
    ("security", {"namespace": ""}, "security.namespace"),
    ("security", {"namespace": "n" * 65}, "security.namespace"),
])
def test_invalid_values_are_rejected_by_name(section: str, overrides: dict[str, Any],
                                             bad: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(bad)}:"):
        load_config(env={}, **{section: overrides})


def test_invalid_env_value_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match=r"transport\.port: 70000 is not a TCP port"):
        load_config(env={"PMETAL_TRANSPORT_PORT": "70000"})


def test_edge_values_are_accepted() -> None:
    cfg = load_config(env={}, transport={"port": 65535}, security={"namespace": "n" * 64})
    assert cfg.transport.port == 65535
    assert load_config(env={"PMETAL_TRANSPORT_PORT": "0"}).transport.port == 0


def test_section_classes_validate_on_construction() -> None:
    with pytest.raises(ConfigError):
        TransportConfig(port=70000)
    with pytest.raises(ConfigError):
        SecurityConfig(namespace="")


def test_configs_are_frozen() -> None:
    cfg = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.transport = TransportConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.transport.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.security.encrypt = True  # type: ignore[misc]


def test_every_field_is_reachable_from_the_environment() -> None:
    """Setting each field to its own default through PMETAL_* changes nothing."""
    defaults = config_as_dict(PMetalConfig())
    env = {f"PMETAL_{section.upper()}_{name.upper()}": str(value)
           for section, fields in defaults.items() for name, value in fields.items()}
    assert load_config(env=env) == PMetalConfig()


def test_config_as_dict_is_plain_and_complete() -> None:
    cfg = load_config(env={}, transport={"port": 6001})
    dumped = config_as_dict(cfg)
    assert dumped["transport"]["port"] == 6001
    assert set(dumped) == {f.name for f in dataclasses.fields(PMetalConfig)}
    assert PMetalConfig(**{k: type(getattr(cfg, k))(**v) for k, v in dumped.items()}) == cfg


def test_pmetal_home_honours_the_variable(tmp_path: Path) -> None:
    assert pmetal_home({"PMETAL_HOME": str(tmp_path)}) == tmp_path
    assert pmetal_home({"PMETAL_HOME": "~/elsewhere"}) == Path.home() / "elsewhere"


def test_pmetal_home_defaults_to_dot_pmetal() -> None:
    assert pmetal_home({}) == Path.home() / ".pmetal"
    assert pmetal_home({"PMETAL_HOME": ""}) == Path.home() / ".pmetal"


def test_config_env_round_trips_every_section() -> None:
    cfg = load_config(env={}, transport={"request_timeout": 7.5, "port": 6001},
                      health={"dead_after": 1.7}, election={"timeout": 1.3},
                      discovery={"enabled": True, "interfaces": "127.0.0.9"},
                      collectives={"compression_ratio": 1e-05, "shared_memory": False},
                      security={"namespace": "lab", "bulk_auth": False})
    assert load_config(env=config_env(cfg)) == cfg
