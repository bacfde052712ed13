"""The client side of the actor runtime: handles, refs, calls and the worker
process that runs an actor. The node daemon's side is :mod:`pmetal.node`."""

__all__: list[str] = []
