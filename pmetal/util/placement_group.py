"""Ray's import path for placement groups
(``from ray.util.placement_group import placement_group, PlacementGroup``).

As in Ray, ``pmetal.util.placement_group`` is the function once
``pmetal.util`` is imported; ``from pmetal.util.placement_group import ...``
reads this module."""

from pmetal.actors.groups import (PlacementGroup, get_current_placement_group,
                                  get_placement_group, placement_group, placement_group_table,
                                  remove_placement_group)

__all__ = ["PlacementGroup", "get_current_placement_group", "get_placement_group",
           "placement_group", "placement_group_table", "remove_placement_group"]
