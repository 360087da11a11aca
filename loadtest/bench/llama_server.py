"""llama.cpp's C++ ``llama-server`` (built by :mod:`loadtest.bench.llama_server_build`) as a
child process, set up like quicsrv: same model, threads, batch, slots of the same context, flash
attention as given, a split KV cache, the extra CPU buffers as quicsrv's canary decided.

It prints ``listening on http://HOST:PORT`` once its model is loaded, so with ``--port 0`` that
line gives both the port and the readiness.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

from loadtest.bench.servers import Child, ServerSettings
from loadtest.bench.servers import _child as child_process

__all__ = ["llama_server", "llama_server_argv"]

_READY = re.compile(r"listening on https?://\S+:(\d+)")


def llama_server_argv(binary: Path, settings: ServerSettings) -> list[str]:
    """The command line: ``settings.parallel`` slots of ``context_per_sequence`` tokens each
    (``-c`` is their sum), every llama.cpp thread count set, prompt caching on (its default,
    named so a changed default cannot silently turn it off)."""
    threads = str(settings.n_threads)
    return [
        str(binary),
        "--model",
        str(settings.model_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        threads,
        "--threads-batch",
        threads,
        "--ctx-size",
        str(settings.context_per_sequence * settings.parallel),
        "--parallel",
        str(settings.parallel),
        "--batch-size",
        str(settings.n_batch),
        "--ubatch-size",
        str(settings.n_batch),
        "--flash-attn",
        "on" if settings.flash_attn else "off",
        # Unified is its default only when the slot count is "auto"; quicsrv keeps them split.
        "--kv-unified" if settings.kv_unified else "--no-kv-unified",
        "--cache-prompt",
        "--no-webui",
        # quicsrv's canary found llama.cpp's extra CPU buffers (AMX, repacked weights) crash
        # here: llama-server's name for turning them off.
        *([] if settings.cpu_extra_buffers else ["--no-repack"]),
    ]


@contextlib.asynccontextmanager
async def llama_server(binary: Path, settings: ServerSettings, log: Path) -> AsyncIterator[Child]:
    """``llama-server`` on 127.0.0.1 on an ephemeral TCP port (plain HTTP), until the block ends."""
    async with child_process(llama_server_argv(binary, settings), log, _READY) as child:
        yield child
