"""Ray's ``ray.dag.output_node`` path (see :mod:`pmetal.actors.dag`)."""

from pmetal.actors.dag import MultiOutputNode

__all__ = ["MultiOutputNode"]
