"""Running one measurement in a fresh interpreter.

llama.cpp's OpenMP threads belong to the thread that decodes: once two threads of one process
have decoded, every decode in it is ~50% slower (measured: main thread 7.4-7.9 ms/step, then
11.4-11.9 in a worker thread and after it on the main thread again). So each in-process
measurement gets a process of its own, as quicsrv's engine worker has its own.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

__all__ = ["isolated"]

_T = TypeVar("_T")


def isolated(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``function(*args, **kwargs)`` in a fresh (spawned) interpreter; its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(function, *args, **kwargs).result()
