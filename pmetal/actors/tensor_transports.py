"""Ray's custom tensor transports (``ray.experimental.register_tensor_transport``,
``@ray.method(tensor_transport=...)``), accepted for Ray's scripts.

In Ray (its "Ray Direct Transport"), an actor method marked
``tensor_transport="name"`` keeps the tensors it returns in its own process
and hands them to the consumer actor through the registered
:class:`TensorTransportManager` (NCCL, Gloo, NIXL, or one of the user's),
instead of through the object store.

pmetal accepts the same calls and checks them (the transport class must be a
concrete TensorTransportManager, the name must be registered before a method
names it), but moves the returned value the way it moves every value: by
shared memory between processes of one machine and in chunks between
machines, through the caller (a top-level ref argument is resolved by the
caller; see docs/api.md). The registered manager's methods are never
called, so a transport with side effects (one that counts its transfers, say)
sees none. What a script computes is the same.
"""

from __future__ import annotations

import abc
import inspect
import threading
from dataclasses import dataclass
from typing import Any

from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = ["BUILTIN", "CommunicatorMetadata", "TensorTransportManager", "TensorTransportMetadata",
           "check_tensor_transport", "register_tensor_transport", "registered"]

BUILTIN = ("object_store",)
"""Ray's default transport (the object store), always accepted."""

_lock = threading.Lock()
_registry: dict[str, tuple[tuple[str, ...], type, type]] = {}   # name -> (devices, class, type)


@dataclass
class TensorTransportMetadata:
    """Ray's: what a transport records about the tensors of one object."""

    tensor_meta: list[Any]
    tensor_device: str | None = None


@dataclass
class CommunicatorMetadata:
    """Ray's: what a transport needs to know about the two ends."""


class TensorTransportManager(abc.ABC):
    """Ray's base class of a tensor transport (its methods, abstract here
    as there; pmetal never calls them, see the module doc)."""

    @abc.abstractmethod
    def tensor_transport_backend(self) -> str: ...

    @staticmethod
    @abc.abstractmethod
    def is_one_sided() -> bool: ...

    @staticmethod
    @abc.abstractmethod
    def can_abort_transport() -> bool: ...

    @abc.abstractmethod
    def actor_has_tensor_transport(self, actor: Any) -> bool: ...

    @abc.abstractmethod
    def extract_tensor_transport_metadata(self, obj_id: str,
                                          rdt_object: list[Any]) -> TensorTransportMetadata: ...

    @abc.abstractmethod
    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any,
                                  backend: str | None = None) -> CommunicatorMetadata: ...

    @abc.abstractmethod
    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: Any,
                              communicator_metadata: Any,
                              target_buffers: list[Any] | None = None) -> Any: ...

    @abc.abstractmethod
    def send_multiple_tensors(self, tensors: list[Any], tensor_transport_metadata: Any,
                              communicator_metadata: Any) -> Any: ...

    @abc.abstractmethod
    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any,
                        tensors: list[Any]) -> None: ...

    @abc.abstractmethod
    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None: ...


def register_tensor_transport(transport_name: str, devices: list[str],
                              transport_manager_class: type,
                              data_type: type | None = None) -> None:
    """Ray's ``register_tensor_transport``: make ``transport_name`` usable
    in ``@pmetal.method(tensor_transport=...)`` (see the module doc for what
    pmetal does with it)."""
    if type(transport_name) is not str or not transport_name:
        raise PMetalTypeError(f"register_tensor_transport: the name must be a non-empty str, "
                              f"not {transport_name!r:.40}")
    if transport_name.lower() in BUILTIN:
        raise PMetalValueError(f"register_tensor_transport: {transport_name!r} is built in")
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not all(
            isinstance(d, str) for d in devices):
        raise PMetalTypeError(f"register_tensor_transport({transport_name!r}): devices must "
                              f"be a list of str such as ['cpu'], not {devices!r:.40}")
    if not (inspect.isclass(transport_manager_class)
            and issubclass(transport_manager_class, TensorTransportManager)):
        raise PMetalTypeError(f"register_tensor_transport({transport_name!r}): the manager "
                              f"must be a subclass of TensorTransportManager, not "
                              f"{transport_manager_class!r:.60}")
    if inspect.isabstract(transport_manager_class):
        missing = sorted(transport_manager_class.__abstractmethods__)
        raise PMetalTypeError(f"register_tensor_transport({transport_name!r}): "
                              f"{transport_manager_class.__name__} does not define "
                              f"{', '.join(missing)}")
    with _lock:
        _registry[transport_name] = (tuple(devices), transport_manager_class,
                                     data_type if data_type is not None else object)


def registered() -> list[str]:
    with _lock:
        return sorted(_registry)


def check_tensor_transport(name: Any, where: str) -> None:
    """Refuse a tensor_transport that is neither built in nor registered."""
    if name is None:
        return
    if type(name) is not str:
        raise PMetalTypeError(f"{where}: tensor_transport must be a str, not "
                              f"{type(name).__name__}")
    if name.lower() in BUILTIN or name in _registry:
        return
    raise PMetalValueError(f"{where}: tensor_transport={name!r} is not registered (registered: "
                           f"{registered() or 'none'}; built in: {list(BUILTIN)}); call "
                           f"pmetal.experimental.register_tensor_transport first")
