"""Ray's ``ray.util`` paths, for code ported from Ray: ``ActorPool``,
``queue`` (``from pmetal.util.queue import Queue``) and
``scheduling_strategies``."""

from pmetal.util import queue, scheduling_strategies
from pmetal.util.actor_pool import ActorPool

__all__ = ["ActorPool", "queue", "scheduling_strategies"]
