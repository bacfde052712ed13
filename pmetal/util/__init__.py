"""Ray's ``ray.util`` paths, for code ported from Ray."""

from pmetal.util import scheduling_strategies

__all__ = ["scheduling_strategies"]
