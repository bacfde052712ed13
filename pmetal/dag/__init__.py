"""Ray's ``ray.dag`` path: build calls with ``.bind()``, run them with
``.execute()`` (see :mod:`pmetal.actors.dag`)."""

from pmetal.actors.dag import (ClassMethodNode, ClassNode, DAGNode, FunctionNode,
                               InputAttributeNode, InputNode, MultiOutputNode)

__all__ = ["ClassMethodNode", "ClassNode", "DAGNode", "FunctionNode", "InputAttributeNode",
           "InputNode", "MultiOutputNode"]
