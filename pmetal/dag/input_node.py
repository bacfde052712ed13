"""Ray's ``ray.dag.input_node`` path (see :mod:`pmetal.actors.dag`)."""

from pmetal.actors.dag import InputAttributeNode, InputNode

__all__ = ["InputAttributeNode", "InputNode"]
