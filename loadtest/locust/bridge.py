"""Run asyncio coroutines (the quicsrv client, on aioquic) from Locust's gevent greenlets.

Design. Locust runs every simulated user as a greenlet on one gevent hub, after
``gevent.monkey.patch_all()``; the client is asyncio code. Running an asyncio loop inside a
greenlet would block the hub (and every other user) whenever the loop waits in ``epoll``, so
each :class:`AsyncioBridge` owns a *real* OS thread running its own asyncio loop, and a
greenlet hands it work and waits in a way that yields to gevent:

* greenlet -> loop: ``loop.call_soon_threadsafe`` creates the task (asyncio's documented
  cross-thread entry point);
* loop -> greenlet: the task's done-callback calls the *greenlet's* hub
  ``loop.run_callback_threadsafe`` (gevent's documented cross-thread entry point, an
  ``ev_async`` wake-up), which sets a ``gevent.event.Event`` on the hub's own thread;
* the greenlet meanwhile waits on that Event, i.e. it is parked on the hub like any gevent
  I/O, and other users run. No lock or gevent object is ever touched from both threads.

Because ``patch_all`` replaced ``threading``, ``selectors`` and ``socket`` before this module
loads, the loop thread is started with the *original* ``_thread.start_new_thread``, the loop
gets the *original* epoll selector, resolves names with the *original* ``getaddrinfo``
inline, and calls for its default executor run inline: gevent's versions would try to switch to a
hub that never runs on that thread. Sockets that aioquic creates are gevent's socket class,
but asyncio only uses them non-blocking (timeout 0), where gevent calls straight through to
the real socket and never waits on a hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import gevent
import gevent.event
from gevent import monkey

__all__ = ["AsyncioBridge", "BridgeTimeout"]

T = TypeVar("T")

_start_thread: Callable[..., int] = monkey.get_original("_thread", "start_new_thread")
_Selector: type[selectors.BaseSelector] = monkey.get_original("selectors", "DefaultSelector")
_getaddrinfo: Callable[..., Any] = monkey.get_original("socket", "getaddrinfo")

#: How long starting or stopping the loop thread may take before that counts as a failure.
_THREAD_TIMEOUT_S = 10.0


class BridgeTimeout(TimeoutError):
    """A coroutine run through the bridge did not finish within its timeout (it is cancelled)."""


class _ThreadLoop(asyncio.SelectorEventLoop):
    """A selector loop that never reaches for gevent's patched resolver or thread pool."""

    def __init__(self) -> None:
        super().__init__(_Selector())

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        if executor is not None:
            return super().run_in_executor(executor, func, *args)
        # The default executor's workers would be gevent-patched threads: run inline instead.
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(func(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future

    async def getaddrinfo(
        self,
        host: bytes | str | None,
        port: bytes | str | int | None,
        *,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[tuple[Any, ...]]:
        # Numeric addresses and /etc/hosts names answer at once; load targets are local.
        return list(_getaddrinfo(host, port, family, type, proto, flags))


class AsyncioBridge:
    """One asyncio loop on its own OS thread; :meth:`run` it from any greenlet."""

    def __init__(self, name: str = "quicsrv-asyncio") -> None:
        self.name = name
        self._hub = gevent.get_hub()
        self._loop: asyncio.AbstractEventLoop | None = None
        started = gevent.event.Event()
        self._stopped = gevent.event.Event()
        _start_thread(self._thread_main, (started,))
        if not started.wait(_THREAD_TIMEOUT_S):
            raise RuntimeError(f"{name}: the asyncio thread did not start")

    def _thread_main(self, started: gevent.event.Event) -> None:
        loop = _ThreadLoop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._hub.loop.run_callback_threadsafe(started.set)
        try:
            loop.run_forever()
            # Let cancelled tasks run their cleanup (stream resets, connection closes).
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=_THREAD_TIMEOUT_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            self._hub.loop.run_callback_threadsafe(self._stopped.set)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop thread; this greenlet waits, yielding to gevent.

        Raises what the coroutine raised, or :class:`BridgeTimeout` after ``timeout_s`` (the
        task is then cancelled). If the greenlet is killed meanwhile (Locust stopping a user),
        the task is cancelled too.
        """
        done = gevent.event.Event()
        holder: list[asyncio.Task[T]] = []
        hub_loop = gevent.get_hub().loop

        def start() -> None:  # on the loop thread
            task = self.loop.create_task(coro)
            holder.append(task)
            task.add_done_callback(lambda _: hub_loop.run_callback_threadsafe(done.set))

        def cancel() -> None:  # on the loop thread, after start() (call_soon is FIFO)
            if holder:
                holder[0].cancel()

        self.loop.call_soon_threadsafe(start)
        try:
            finished = done.wait(timeout_s)
        except BaseException:  # GreenletExit: the user is being stopped
            self.loop.call_soon_threadsafe(cancel)
            raise
        if not finished:
            self.loop.call_soon_threadsafe(cancel)
            raise BridgeTimeout(f"no result within {timeout_s:g}s")
        return holder[0].result()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` on the loop thread and do not wait (best-effort cleanup)."""
        try:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(coro))
        except RuntimeError:  # the loop is already closed
            coro.close()

    def stop(self) -> None:
        """Stop the loop (pending tasks are cancelled and cleaned up) and wait for the thread."""
        if self._stopped.is_set():
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._stopped.wait(_THREAD_TIMEOUT_S)
