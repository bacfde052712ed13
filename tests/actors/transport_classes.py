"""A tensor transport and an actor that names it, for
test_tensor_transports.py (imported by reference in the workers)."""

from __future__ import annotations

from typing import Any

import numpy

import pmetal
from pmetal.experimental import (CommunicatorMetadata, TensorTransportManager,
                                 TensorTransportMetadata, register_tensor_transport)


class Loopback(TensorTransportManager):
    def tensor_transport_backend(self) -> str:
        return "loopback"

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True

    def extract_tensor_transport_metadata(self, obj_id: str,
                                          rdt_object: list[Any]) -> TensorTransportMetadata:
        return TensorTransportMetadata([(t.shape, t.dtype) for t in rdt_object], "cpu")

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                              communicator_metadata: Any,
                              target_buffers: list[Any] | None = None) -> Any:
        raise NotImplementedError

    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> Any:
        raise NotImplementedError

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any,
                        tensors: list[Any]) -> None:
        pass

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        pass


register_tensor_transport("loopback", ["cpu"], Loopback, numpy.ndarray)


@pmetal.remote
class Holder:
    @pmetal.method(tensor_transport="loopback")
    def echo(self, data: Any) -> Any:
        return data

    def total(self, data: Any) -> int:
        return int(data.sum())
