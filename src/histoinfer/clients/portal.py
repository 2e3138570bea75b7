"""An event loop on a daemon thread: how sync calls from plain threads reach async code.

``anyio.from_thread.start_blocking_portal`` runs its loop on a non-daemon thread, so a client
that is never closed would hang the interpreter at exit. This portal's thread is a daemon, and
its owner stops it cleanly when it closes, is dropped, or the interpreter exits.

A call is one hand-off: a callback scheduled on the loop starts the call's task, and the
caller waits for its answer. anyio's ``BlockingPortal.call`` first waits for the loop to start
the call's task, then for its result: two wake-ups of the calling thread a call, and with
hundreds of threads calling at once, beside forward passes on every core, the loop's answers to
those first waits queued behind everything else. Threads calling ``predict``, this portal
against BlockingPortal in one process, alternating (two runs, medians of 4 rounds each): 8
threads 1.10x and 1.10x, 64 1.16x and 1.05x, 512 1.09x and 1.19x the throughput
(docs/benchmarks-history.md, "Session 17").

What BlockingPortal guaranteed, this one does too: the call runs in a copy of the calling
thread's context (its context variables: logging or tracing ids), less sniffio's marker (a
thread running a trio loop must not make anyio take the portal's asyncio task for a trio
one); an exception reaches the caller, ``KeyboardInterrupt`` and ``SystemExit`` included
(they stop that call, not the loop); a call from the portal's own thread is refused (it would
wait for itself); calls in flight when the portal stops are let finish, later ones are
refused with RuntimeError; and no caller is ever left waiting: should the loop end under a
call, the call fails with RuntimeError.

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
from typing import Any, TypeVar, TypeVarTuple, Unpack

import anyio
import sniffio

__all__ = ["PortalThread"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: How often a stopping portal looks whether its last callers have their answers, at most.
_DRAIN_POLL_S = 0.05


class PortalThread:
    """An asyncio event loop on a daemon thread, reachable from any thread via ``call``."""

    def __init__(self, name: str = "histoinfer-portal") -> None:
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._open = False  # taking calls
        #: calls made and not yet answered (failed, should the loop end under them)
        self._unanswered: set[concurrent.futures.Future[Any]] = set()
        #: the calls' tasks: the loop holds tasks only weakly
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # pragma: no cover - loop failed to start
            raise RuntimeError("could not start the portal's event loop") from self._error

    def _main(self) -> None:
        ended: BaseException | None = None
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:
            ended = exc
            if not self._ready.is_set():  # pragma: no cover - the loop failed to start
                self._error = exc
                self._ready.set()
        finally:
            with self._lock:
                self._open = False
                left, self._unanswered = list(self._unanswered), set()
            for answer in left:  # the loop ended under them (only if it died)
                _fail(answer, RuntimeError(f"the portal's event loop ended: {ended!r}"))

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self._open = True
        self._ready.set()
        await self._stop_requested.wait()
        # No new call gets in (stop() closed the door first); the ones in flight finish, and the
        # loop runs until each is answered: a task scheduled but not yet started when the loop
        # ended would leave its caller waiting (_main fails any that remain, should it die).
        pause = 0.001
        while self._unanswered:
            await asyncio.sleep(pause)
            pause = min(2 * pause, _DRAIN_POLL_S)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
        """``await fn(*args)`` in the portal's loop, from another thread; its result or error.
        RuntimeError if the portal is stopping or stopped, or from the portal's own thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a call from the portal's own thread would wait for itself")
        answer: concurrent.futures.Future[T] = concurrent.futures.Future()
        context = contextvars.copy_context()
        context.run(sniffio.current_async_library_cvar.set, None)
        try:
            with self._lock:
                loop = self._loop
                if not self._open or loop is None:
                    raise RuntimeError("the portal is stopped")
                self._unanswered.add(answer)
            loop.call_soon_threadsafe(self._start, fn, args, answer, context=context)
            return answer.result()
        finally:
            with self._lock:
                self._unanswered.discard(answer)
            del answer  # its error's traceback holds this frame: no cycle (see _answer)

    def _start(
        self,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        answer: concurrent.futures.Future[T],
    ) -> None:
        """In the loop, in the caller's context: run ``fn(*args)`` as a task that answers."""
        if answer.set_running_or_notify_cancel():
            task = asyncio.ensure_future(_answer(fn, args, answer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def stop(self, timeout: float = 10.0) -> None:
        """Let running calls finish, then end the loop and (unless called from it) join its
        thread, for at most ``timeout`` seconds (0: do not wait). Idempotent, and a later call
        joins a portal stopped without waiting; never raises.
        """
        with self._lock:
            was_open, self._open = self._open, False
        loop, stop_requested = self._loop, self._stop_requested
        if loop is None or stop_requested is None:
            return
        if was_open:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(stop_requested.set)
        if timeout > 0 and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


async def _answer(
    fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], answer: concurrent.futures.Future[T]
) -> None:
    """``await fn(*args)``, its outcome set on ``answer``. A ``KeyboardInterrupt`` or
    ``SystemExit`` goes to the caller, as if the call had run on its own thread: raised here,
    asyncio would let it out of the loop, and end the portal under every other call."""
    try:
        result = await fn(*args)
    except asyncio.CancelledError:
        _fail(answer, RuntimeError("the call was cancelled in the portal's event loop"))
        raise
    except BaseException as exc:  # delivered, not raised: see above
        _fail(answer, exc)
        # The error's traceback holds this frame, which must not hold the error: a cycle would
        # keep the call's memory (its body, its tile) until the collector's next full pass.
        del answer, args
    else:
        if not answer.done():
            answer.set_result(result)


def _fail(answer: concurrent.futures.Future[Any], error: BaseException) -> None:
    if not answer.done():
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # answered meanwhile
            answer.set_exception(error)
