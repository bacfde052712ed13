"""Pipeline-parallel inference: layer assignment, the activation codec,
sampling (so far; the stages, the model and the generation loop come with
the rest of the pipeline issue). See docs/pipeline.md."""

from pmetal.pipeline.activations import ActivationCodec, ActivationMessage, DtypeTag
from pmetal.pipeline.assignment import (
    Assignment,
    Link,
    ModelProfile,
    Stage,
    StageNode,
    assign_layers_bandwidth_aware,
    assign_layers_proportional,
)
from pmetal.pipeline.sampling import Sampler, SamplingConfig

__all__ = [
    "ActivationCodec",
    "ActivationMessage",
    "Assignment",
    "DtypeTag",
    "Link",
    "ModelProfile",
    "Sampler",
    "SamplingConfig",
    "Stage",
    "StageNode",
    "assign_layers_bandwidth_aware",
    "assign_layers_proportional",
]
