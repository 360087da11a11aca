from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from quicsrv.engine.vocab import Vocabulary


@pytest.fixture(scope="session")
def vocab(model_path: Path) -> Iterator[Vocabulary]:
    """The default model's vocabulary alone (no weights): for grammars and tokens."""
    loaded = Vocabulary.load(model_path)
    yield loaded
    loaded.close()
