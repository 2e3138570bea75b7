"""``PerLoop``: one value per running event loop, created lazily, dropped when the loop ends.

Keyed on the loop's *native* token (the asyncio loop, or trio's ``TrioToken``): anyio's
``current_token()`` returns a new, equal wrapper on each call. A plain dict under a
``threading.Lock`` is used rather than a ``WeakKeyDictionary``: the values (schedulers with
tasks and streams) reference their loop, so weak keys would never be freed. Instead the owner
calls :meth:`discard` when the loop's scheduler ends, and every new lookup purges loops that have
finished without saying so.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["PerLoop", "call_soon_in_loop", "current_loop_key", "wait_future"]

V = TypeVar("V")
R = TypeVar("R")


def current_loop_key() -> object:
    """The native identity of the running event loop."""
    return anyio.lowlevel.current_token().native_token


def _loop_finished(key: object) -> bool:
    if isinstance(key, asyncio.AbstractEventLoop):
        return key.is_closed()
    run_sync_soon = getattr(key, "run_sync_soon", None)
    if run_sync_soon is None:  # pragma: no cover - unknown backend
        return False
    try:
        run_sync_soon(lambda: None)
    except Exception:  # trio.RunFinishedError: that run is over
        return True
    return False


def call_soon_in_loop(key: object, fn: Callable[[], object]) -> bool:
    """Schedule ``fn()`` in the loop ``key`` from any thread, without waiting; False if that
    loop has ended. (``anyio.from_thread`` blocks, and deadlocks when called from the loop's own
    thread; this never blocks.)
    """
    try:
        if isinstance(key, asyncio.AbstractEventLoop):
            key.call_soon_threadsafe(fn)
        else:
            key.run_sync_soon(fn)  # type: ignore[attr-defined]
    except Exception:  # RuntimeError (asyncio loop closed), trio.RunFinishedError
        return False
    return True


async def wait_future(future: Future[R], *, start_by: float | None = None) -> R:
    """The result of a ``concurrent.futures.Future`` that another thread completes.

    No worker thread waits for it: the thread that completes it wakes this loop directly.
    A caller cancelled while the work still waits for its thread cancels it (``Future.cancel``:
    it never runs, e.g. behind another job on a busy device); one cancelled while it runs
    leaves at once, and the work completes without it.

    ``start_by`` (a ``time.perf_counter()`` time): if the work has not started by then, it is
    cancelled and :class:`TimeoutError` raised; once started, it is waited for to the end.
    """
    if not future.done():
        key = current_loop_key()
        done = anyio.Event()
        future.add_done_callback(lambda _: call_soon_in_loop(key, done.set))
        try:
            if start_by is not None:
                with anyio.move_on_after(start_by - time.perf_counter()):
                    await done.wait()
                if not future.done() and future.cancel():
                    raise TimeoutError("the work did not start in time")
            await done.wait()
        except BaseException:
            future.cancel()  # not started: it never will (a running one completes unseen)
            raise
    try:
        return future.result()
    finally:
        del future  # it holds its error, whose traceback holds this frame (histoinfer/outcome.py)


#: what forked children's PerLoops forgot (see :meth:`PerLoop.forget_after_fork`)
_LEFT_BY_THE_PARENT: list[object] = []


class PerLoop(Generic[V]):
    """A value per event loop, made by ``factory(key)`` on first use in that loop."""

    def __init__(self, factory: Callable[[object], V]) -> None:
        self._factory = factory
        self._values: dict[object, V] = {}
        self._lock = threading.Lock()

    def get(self) -> V:
        key = current_loop_key()
        with self._lock:
            value = self._values.get(key)
            if value is None:
                self._purge_finished()
                value = self._values[key] = self._factory(key)
            return value

    def discard(self, key: object, value: V | None = None) -> None:
        """Forget ``key``'s value (only if it is still ``value``, when given)."""
        with self._lock:
            if value is None or self._values.get(key) is value:
                self._values.pop(key, None)

    def clear(self) -> list[V]:
        """Forget every value, and return them (e.g. to close them)."""
        with self._lock:
            values = list(self._values.values())
            self._values.clear()
            return values

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's loops do not run here. Their values are forgotten,
        not closed (closing one would reach for the parent's loop), and kept for the life of
        the process: collected, their tasks would say "Task was destroyed but it is pending!"
        """
        self._lock = threading.Lock()  # the parent's threads may have held it
        _LEFT_BY_THE_PARENT.extend(self._values.values())
        self._values = {}

    def values(self) -> list[V]:
        with self._lock:
            self._purge_finished()
            return list(self._values.values())

    def __len__(self) -> int:
        with self._lock:
            self._purge_finished()
            return len(self._values)

    def _purge_finished(self) -> None:
        for key in [k for k in self._values if _loop_finished(k)]:
            del self._values[key]
