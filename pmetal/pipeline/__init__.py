"""Pipeline-parallel inference: a model's layers split over stage actors
on the cluster's machines, joined in a ring of TCP links, generating
several sequences at once. ``Pipeline.from_pretrained(...).generate(...)``
is the entry point; below it the model store and loaders, the tokenizer,
the numpy (and MLX) Llama decoder, layer assignment, the activation codec,
sampling, the stages and the generation loop. See docs/pipeline.md."""

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
from pmetal.pipeline.batching import ContinuousBatcher
from pmetal.pipeline.generation import (
    GenerationResult,
    PipelineGenerationLoop,
    StreamMultiplexer,
    generate_single_process,
)
from pmetal.pipeline.llama import (
    SMOLLM2_135M,
    KVCache,
    LayerWeights,
    LlamaConfig,
    LlamaStage,
    LlamaWeights,
)
from pmetal.pipeline.backends import build_stage
from pmetal.pipeline.llama_mlx import MlxLlamaStage
from pmetal.pipeline.loader import load_config, load_quantized, load_weights
from pmetal.pipeline.models import ModelStore, list_models, remove_model, resolve_model
from pmetal.pipeline.pipeline import Pipeline
from pmetal.pipeline.placement import StagePlacement, StagePlan, place_stages, plan_stages
from pmetal.pipeline.sampling import Sampler, SamplingConfig
from pmetal.pipeline.stage import (
    PipelineStage,
    PipelineStageConfig,
    PipelineStageRuntime,
)
from pmetal.pipeline.tokenizer import StreamDecoder, Tokenizer

__all__ = [  # noqa: RUF022 - plain sorted order, as test_public_api wants
    "ActivationCodec",
    "ActivationMessage",
    "Assignment",
    "ContinuousBatcher",
    "DtypeTag",
    "GenerationResult",
    "KVCache",
    "LayerWeights",
    "Link",
    "LlamaConfig",
    "LlamaStage",
    "LlamaWeights",
    "MlxLlamaStage",
    "ModelProfile",
    "ModelStore",
    "Pipeline",
    "PipelineGenerationLoop",
    "PipelineStage",
    "PipelineStageConfig",
    "PipelineStageRuntime",
    "SMOLLM2_135M",
    "Sampler",
    "SamplingConfig",
    "Stage",
    "StageNode",
    "StagePlacement",
    "StagePlan",
    "StreamDecoder",
    "StreamMultiplexer",
    "Tokenizer",
    "assign_layers_bandwidth_aware",
    "assign_layers_proportional",
    "build_stage",
    "generate_single_process",
    "list_models",
    "load_config",
    "load_quantized",
    "load_weights",
    "place_stages",
    "plan_stages",
    "remove_model",
    "resolve_model",
]
