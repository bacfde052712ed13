"""pmetal benchmarks: ``python -m benchmarks`` prints every table."""
