"""The exception tree drawn in the docstring of pmetal/errors.py is the real one."""

from __future__ import annotations

import builtins
import pickle
import re

import pytest

from pmetal import errors
from pmetal.errors import (
    ConfigError,
    PMetalError,
    PMetalTimeoutError,
    RemoteError,
    RequestTimeoutError,
)

# "│   ├── ConfigError (ValueError)   bad setting" -> indent, name, extra bases
_NODE = re.compile(r"^(?P<indent>[ │]*)[├└]── (?P<name>\w+)(?: \((?P<extra>[\w, ]+)\))?")


def drawn_tree() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each class in the drawing -> (its parent, the builtins it also derives from)."""
    doc = errors.__doc__ or ""
    root = re.search(r"^( *)PMetalError$", doc, re.MULTILINE)
    assert root is not None, "the docstring draws no tree rooted at PMetalError"
    margin = len(root[1])
    tree: dict[str, tuple[str, tuple[str, ...]]] = {}
    parents = ["PMetalError"]  # parents[d] is the latest class drawn at depth d
    for line in doc[root.end() + 1:].splitlines():
        if not line.strip():
            break
        node = _NODE.match(line[margin:])
        if node is None:  # a description running onto a second line
            continue
        depth = len(node["indent"]) // 4 + 1
        extra = tuple(n.strip() for n in node["extra"].split(",")) if node["extra"] else ()
        tree[node["name"]] = (parents[depth - 1], extra)
        del parents[depth:]
        parents.append(node["name"])
    return tree


def test_the_drawing_parses() -> None:
    tree = drawn_tree()
    assert tree["ConfigError"] == ("PMetalError", ("ValueError",))
    assert tree["ReplayError"] == ("AuthenticationError", ())
    assert tree["RequestTimeoutError"] == ("PMetalTimeoutError", ())


def test_the_drawing_names_every_exported_exception() -> None:
    assert set(drawn_tree()) | {"PMetalError"} == set(errors.__all__)


@pytest.mark.parametrize("name", sorted(drawn_tree()))
def test_each_class_has_the_bases_drawn(name: str) -> None:
    parent, extra = drawn_tree()[name]
    cls = getattr(errors, name)
    expected = (getattr(errors, parent), *(getattr(builtins, b) for b in extra))
    assert cls.__bases__ == expected


@pytest.mark.parametrize("name", errors.__all__)
def test_every_exported_exception_derives_from_pmetal_error(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, PMetalError)
    assert cls.__module__ == "pmetal.errors"
    assert cls.__doc__, f"{name} has no docstring"


def test_pmetal_error_is_an_exception_not_a_base_exception() -> None:
    assert PMetalError.__bases__ == (Exception,)


@pytest.mark.parametrize("name", [n for n in errors.__all__
                                  if issubclass(getattr(errors, n), PMetalTimeoutError)])
def test_timeouts_are_builtin_timeouts(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, TimeoutError)
    with pytest.raises(TimeoutError):
        raise cls("deadline passed")


def test_only_timeouts_are_builtin_timeouts() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, TimeoutError) == issubclass(cls, PMetalTimeoutError), name


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        raise ConfigError("transport.port: bad")


def test_request_timeout_is_caught_by_every_level() -> None:
    for catch in (RequestTimeoutError, PMetalTimeoutError, PMetalError, TimeoutError, OSError):
        with pytest.raises(catch):
            raise RequestTimeoutError("no reply")


@pytest.mark.parametrize("name", errors.__all__)
def test_simple_exceptions_pickle(name: str) -> None:
    """Errors cross process boundaries (worker to caller), so they must pickle."""
    cls = getattr(errors, name)
    err = RemoteError("ValueError", "bad", "tb") if cls is RemoteError else cls("message")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
