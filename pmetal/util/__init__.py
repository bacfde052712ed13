"""Ray's ``ray.util`` paths, for code ported from Ray."""
