"""An event loop on a daemon thread: how sync calls from plain threads reach async code.

``anyio.from_thread.start_blocking_portal`` runs its loop on a non-daemon thread, so a client
that is never closed would hang the interpreter at exit. This portal's thread is a daemon, and
its owner stops it cleanly when it closes, is dropped, or the interpreter exits.

A call is one hand-off: a callback scheduled on the loop starts the call's task, and the
caller waits for its result. anyio's ``BlockingPortal.call`` first waits for the loop to start
the call's task, then for its result: two wake-ups of the calling thread a call, and with
hundreds of threads calling at once, beside forward passes on every core, the loop's answers to
those first waits queued behind everything else. Threads calling ``predict``, this portal
against BlockingPortal in one process, alternating (medians of 4 rounds): 8 threads 1.10x, 64
1.16x, 512 1.09x the throughput (docs/benchmarks-history.md, "Session 17"). The bookkeeping
BlockingPortal did is done here:
calls in flight when the portal stops are let finish (and the loop keeps running until their
callers have their answers), and a call made once it is stopping is refused with RuntimeError,
never left waiting.

``stop()`` may be called from any thread, including the portal's own (a garbage-collection
finalizer can run there): it asks the loop to stop with a thread-safe callback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar, TypeVarTuple, Unpack

import anyio

__all__ = ["PortalThread"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: How often a stopping portal looks whether its last callers have their answers.
_DRAIN_POLL_S = 0.002


class PortalThread:
    """An asyncio event loop on a daemon thread, reachable from any thread via ``call``."""

    def __init__(self, name: str = "histoinfer-portal") -> None:
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._open = False  # taking calls
        self._in_flight = 0  # calls made and not yet answered to their threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.Context()  # the loop's own, once it runs
        self._stop_requested: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # pragma: no cover - loop failed to start
            raise RuntimeError("could not start the portal's event loop") from self._error

    def _main(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:  # pragma: no cover
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._stop_requested = asyncio.Event()
        self._open = True
        self._ready.set()
        await self._stop_requested.wait()
        # No new call gets in (stop() closed the door first); the ones in flight finish, and the
        # loop runs until each caller has its answer: a task scheduled but not yet started
        # when the loop ended would leave its caller waiting forever.
        while self._in_flight:
            await asyncio.sleep(_DRAIN_POLL_S)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
        """``await fn(*args)`` in the portal's loop, from another thread; its result or error.
        RuntimeError if the portal is stopping or stopped."""
        with self._lock:
            loop = self._loop
            if not self._open or loop is None:
                raise RuntimeError("the portal is stopped")
            self._in_flight += 1
        try:
            answer: concurrent.futures.Future[T] = concurrent.futures.Future()
            # Started in the portal's own context, not a copy of the calling thread's: a
            # thread running a trio loop has sniffio's "trio" in its context, and anyio would
            # then take the portal's asyncio task for a trio one.
            loop.call_soon_threadsafe(_start, fn, args, answer, context=self._context)
            try:
                return answer.result()
            except concurrent.futures.CancelledError:  # pragma: no cover - the loop was torn down
                raise RuntimeError("the portal is stopped") from None
        finally:
            with self._lock:
                self._in_flight -= 1

    def stop(self, timeout: float = 10.0) -> None:
        """Let running calls finish, then end the loop and (unless called from it) join its
        thread, for at most ``timeout`` seconds. Idempotent; never raises.
        """
        with self._lock:
            was_open, self._open = self._open, False
        loop, stop_requested = self._loop, self._stop_requested
        if not was_open or loop is None or stop_requested is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(stop_requested.set)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def _start(
    fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], answer: concurrent.futures.Future[T]
) -> None:
    """In the portal's loop: run ``fn(*args)`` as a task whose outcome becomes ``answer``'s."""
    if answer.set_running_or_notify_cancel():
        task = asyncio.ensure_future(_awaited(fn, *args))
        task.add_done_callback(partial(_settle, answer))


async def _awaited(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    return await fn(*args)  # a task needs a coroutine; fn may return any awaitable


def _settle(answer: concurrent.futures.Future[T], task: asyncio.Future[T]) -> None:
    if task.cancelled():
        answer.cancel()
    elif (error := task.exception()) is not None:
        answer.set_exception(error)
    else:
        answer.set_result(task.result())
