"""Ray's import path for scheduling strategies
(``from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy,
PlacementGroupSchedulingStrategy``)."""

from pmetal.actors.strategies import (NodeAffinitySchedulingStrategy,
                                      PlacementGroupSchedulingStrategy)

__all__ = ["NodeAffinitySchedulingStrategy", "PlacementGroupSchedulingStrategy"]
