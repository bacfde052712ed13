"""Ray's import path for scheduling strategies
(``from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy``)."""

from pmetal.actors.strategies import NodeAffinitySchedulingStrategy

__all__ = ["NodeAffinitySchedulingStrategy"]
