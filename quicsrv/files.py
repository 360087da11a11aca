"""Files written whole: what a crash or a concurrent reader may see of them."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(
    path: Path, *parts: bytes | memoryview, before_part: Callable[[], object] | None = None
) -> None:
    """Write ``parts`` to ``path`` through a temporary file beside it (0600, ``O_EXCL``) and a
    rename: readers see the old file or the new one, never half. Raises ``OSError`` (a full
    disk); the temporary file is gone then. ``before_part`` is called before each part is
    written (a writer that yields to other work between parts)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                if before_part is not None:
                    before_part()
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
