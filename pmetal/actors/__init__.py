"""System actors (Node, Health, Election), workers and actor handles.

Filled by the actor runtime issue; the package exists so the layout is fixed."""

__all__: list[str] = []
