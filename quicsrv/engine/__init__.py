"""The generation engine: llama.cpp behind a small interface. Knows nothing of QUIC."""

from ._api import (
    CannotReplay,
    CpuExtraBuffers,
    Engine,
    EngineError,
    EngineUnavailable,
    FinishReason,
    Overloaded,
    PausedState,
    PrefillPlan,
    PromptTooLong,
    ResumePath,
    ResumePoint,
    SamplingParams,
    Segment,
    SequenceHandle,
    SequenceRequest,
    TokenSink,
)
from .model import default_model_path

__all__ = [
    "CannotReplay",
    "CpuExtraBuffers",
    "Engine",
    "EngineError",
    "EngineUnavailable",
    "FinishReason",
    "Overloaded",
    "PausedState",
    "PrefillPlan",
    "PromptTooLong",
    "ResumePath",
    "ResumePoint",
    "SamplingParams",
    "Segment",
    "SequenceHandle",
    "SequenceRequest",
    "TokenSink",
    "default_model_path",
]
