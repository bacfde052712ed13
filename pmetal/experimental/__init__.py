"""Ray's ``ray.experimental`` path: what of it pmetal has
(:mod:`pmetal.experimental.tqdm_ray`; the tensor transport registry of
:mod:`pmetal.actors.tensor_transports`, accepted and checked, with data
moved by pmetal's own paths)."""

from pmetal.actors.tensor_transports import (CommunicatorMetadata, TensorTransportManager,
                                             TensorTransportMetadata, register_tensor_transport)

__all__ = ["CommunicatorMetadata", "TensorTransportManager", "TensorTransportMetadata",
           "register_tensor_transport"]
