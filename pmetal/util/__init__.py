"""Ray's ``ray.util`` paths, for code ported from Ray: ``ActorPool``,
``queue`` (``from pmetal.util.queue import Queue``), placement groups
(``placement_group``, ``remove_placement_group``, ``get_placement_group``,
``placement_group_table``, ``PlacementGroup``; also under
``pmetal.util.placement_group``) and ``scheduling_strategies``."""

from pmetal.util import queue, scheduling_strategies
from pmetal.util.actor_pool import ActorPool
from pmetal.util.placement_group import (PlacementGroup, get_current_placement_group,
                                         get_placement_group, placement_group,
                                         placement_group_table, remove_placement_group)

__all__ = ["ActorPool", "PlacementGroup", "get_current_placement_group", "get_placement_group",
           "placement_group", "placement_group_table", "queue", "remove_placement_group",
           "scheduling_strategies"]
