"""Collective operations (ring, tree, naive) scheduled by the elected master.

Filled by the collectives issue; the package exists so the layout is fixed."""

from pmetal.collectives.compression import (
    Compressed,
    CompressionConfig,
    CompressionStatistics,
    CompressionStrategy,
    GradientCompressor,
    QuantizationType,
    aggregate,
    decompress,
)

__all__: list[str] = [
    "Compressed",
    "CompressionConfig",
    "CompressionStatistics",
    "CompressionStrategy",
    "GradientCompressor",
    "QuantizationType",
    "aggregate",
    "decompress",
]
