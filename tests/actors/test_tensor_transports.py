"""Ray's custom tensor transports (``pmetal.experimental.register_tensor_transport``
and ``@pmetal.method(tensor_transport=...)``): accepted and checked; the
value moves by pmetal's own paths (pmetal.actors.tensor_transports)."""

from __future__ import annotations

from typing import Any

import numpy
import pytest

import pmetal
from pmetal.errors import PMetalTypeError, PMetalValueError
from pmetal.experimental import TensorTransportManager, register_tensor_transport

from .conftest import WAIT
from .transport_classes import Holder, Loopback

NUM_WORKERS = 1


def test_a_method_marked_with_a_registered_transport_hands_its_value_on(
        cluster: dict[str, Any], reap: list[Any]) -> None:
    first, second = Holder.remote(), Holder.remote()
    reap.extend([first, second])
    ref = first.echo.remote(numpy.arange(1, 4))
    assert pmetal.get(second.total.remote(ref), timeout=WAIT) == 6
    assert pmetal.get(ref, timeout=WAIT).tolist() == [1, 2, 3]


def test_unknown_or_malformed_transports_are_refused() -> None:
    with pytest.raises(PMetalValueError, match="tensor_transport='nccl' is not registered"):
        pmetal.method(tensor_transport="nccl")
    pmetal.method(tensor_transport="object_store")   # Ray's default: always there
    with pytest.raises(PMetalTypeError, match="subclass of TensorTransportManager"):
        register_tensor_transport("mine", ["cpu"], object)

    class Half(TensorTransportManager):
        def tensor_transport_backend(self) -> str:
            return "half"
    with pytest.raises(PMetalTypeError, match="Half does not define abort_transport"):
        register_tensor_transport("half", ["cpu"], Half)
    with pytest.raises(PMetalTypeError, match="devices must be a list of str"):
        register_tensor_transport("mine", "cpu", Loopback)
    with pytest.raises(PMetalValueError, match="'object_store' is built in"):
        register_tensor_transport("object_store", ["cpu"], Loopback)
