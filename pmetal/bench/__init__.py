"""Benchmarks users run on their own machines: ``pmetal bench allreduce``
(:mod:`pmetal.bench.allreduce`). They live in the package, not in the
repository's ``benchmarks/`` folder, so that an installed pmetal can
measure itself; ``python -m benchmarks allreduce`` runs the same code."""

__all__: list[str] = []
