"""What the model file says about itself: the facts clients ask for (``GET /props``, the
``meta`` of ``/v1/models`` entries), read once from the GGUF's vocabulary and header.

Plain values only, no llama.cpp: the HTTP layer shapes them, the vocabulary fills them
(:func:`.vocab.describe_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelInfo"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """The model file's own facts (none of this server's settings)."""

    file_name: str
    """The GGUF's file name (not its directory: that is the server's business)."""
    name: str | None
    """``general.name`` from the header, if the file has one."""
    architecture: str | None
    """``general.architecture`` (``llama``, ``gemma3``...)."""
    n_vocab: int
    """Tokens in the vocabulary: a token id is valid when ``0 <= id < n_vocab``."""
    vocab_type: int
    """llama.cpp's ``llama_vocab_type`` (1 SentencePiece, 2 byte-level BPE...)."""
    n_ctx_train: int | None
    """The context the model was trained with (``<arch>.context_length``)."""
    n_embd: int | None
    """Embedding width (``<arch>.embedding_length``)."""
    n_params: int
    """Parameters in the weights."""
    size_bytes: int
    """Bytes of the weights' tensors (llama.cpp's ``llama_model_size``)."""
    chat_template: str | None
    """The Jinja chat template prompts are rendered with: the file's, or
    ``chat_template_file``'s (None: the server's plain fallback)."""
    bos_token: str | None
    """The beginning-of-sequence token's text."""
    eos_token: str | None
    """The end-of-sequence token's text."""
    tool_call_format: str | None = None
    """How the chat template shows tools and calls: ``hermes`` (``<tool_call>`` JSON), or
    None (it renders none: the generic format, :mod:`quicsrv.http.tool_format`)."""
