"""Ray's ``ray.actor`` module path: the actor types, for scripts that
annotate with them (``def work(counter: ray.actor.ActorHandle)``).

``exit_actor`` is not here: a pmetal actor ends by ``pmetal.kill`` or when
its creator leaves (docs/ray-compat.md).
"""

from pmetal.actors.handles import ActorClass, ActorHandle, ActorMethod, method

__all__ = ["ActorClass", "ActorHandle", "ActorMethod", "method"]
