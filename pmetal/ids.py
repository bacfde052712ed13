"""Distinct identifier types, so a node id is never passed where an actor id
belongs. They are plain ``str`` at run time (cheap on the wire)."""

from __future__ import annotations

from typing import NewType

__all__ = ["ActorId", "NodeId", "ObjectId"]

NodeId = NewType("NodeId", str)
"""32 hex characters: the first 16 bytes of SHA-256 of the node's Ed25519
public key."""

ActorId = NewType("ActorId", str)
ObjectId = NewType("ObjectId", str)
