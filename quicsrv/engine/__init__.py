"""The generation engine: llama.cpp behind a small interface. Knows nothing of QUIC."""

from ._api import (
    CpuExtraBuffers,
    Engine,
    EngineError,
    EngineUnavailable,
    FinishReason,
    Overloaded,
    PausedState,
    PromptTooLong,
    ResumePath,
    ResumePoint,
    SamplingParams,
    SequenceHandle,
    SequenceRequest,
    TokenSink,
)
from .model import default_model_path

__all__ = [
    "CpuExtraBuffers",
    "Engine",
    "EngineError",
    "EngineUnavailable",
    "FinishReason",
    "Overloaded",
    "PausedState",
    "PromptTooLong",
    "ResumePath",
    "ResumePoint",
    "SamplingParams",
    "SequenceHandle",
    "SequenceRequest",
    "TokenSink",
    "default_model_path",
]
