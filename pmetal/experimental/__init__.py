"""Ray's ``ray.experimental`` path: what of it pmetal has
(:mod:`pmetal.experimental.tqdm_ray`)."""

__all__: list[str] = []
