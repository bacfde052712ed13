"""Pipeline-parallel inference: the numpy Llama decoder a stage runs,
layer assignment, the activation codec and sampling (so far; the model
loaders, the stage actors and the generation loop come with the rest of
the pipeline issue). See docs/pipeline.md."""

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
from pmetal.pipeline.llama import (
    SMOLLM2_135M,
    KVCache,
    LayerWeights,
    LlamaConfig,
    LlamaStage,
    LlamaWeights,
)
from pmetal.pipeline.sampling import Sampler, SamplingConfig

__all__ = [  # noqa: RUF022 - plain sorted order, as test_public_api wants
    "ActivationCodec",
    "ActivationMessage",
    "Assignment",
    "DtypeTag",
    "KVCache",
    "LayerWeights",
    "Link",
    "LlamaConfig",
    "LlamaStage",
    "LlamaWeights",
    "ModelProfile",
    "SMOLLM2_135M",
    "Sampler",
    "SamplingConfig",
    "Stage",
    "StageNode",
    "assign_layers_bandwidth_aware",
    "assign_layers_proportional",
]
