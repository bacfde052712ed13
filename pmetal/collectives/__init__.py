"""Collective operations (ring, tree, naive) scheduled by the elected master.

Filled by the collectives issue; the package exists so the layout is fixed."""

__all__: list[str] = []
