"""The model engine's compute: quantized weight kernels (:mod:`pmetal.model.kernels`).

Kept apart from :mod:`pmetal.pipeline`, which distributes a model across
stages: this package only computes.
"""

__all__: list[str] = []
