"""Pipeline-parallel inference: stages, layer assignment, activation codec.

Filled by the pipeline issue; the package exists so the layout is fixed."""

__all__: list[str] = []
