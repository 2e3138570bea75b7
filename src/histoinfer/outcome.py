"""A worker thread's result or error, raised in its caller's task without a reference cycle.

An exception's traceback holds every frame it passed through, and a finished frame keeps its
locals. A frame that holds the exception as well (a future it was set on, a list of results
it is one of) makes a cycle, which reference counting never frees: only the collector's next
full pass does, and until then the failed call's bodies, tiles and batch stay in memory. A
refused request is everyday input, so that was hundreds of MB under a stream of bad requests
(and, freed late and in pieces, a heap that never shrank back). ``anyio.to_thread.run_sync``
is such a frame on trio and asyncio alike: an error raised by its function is held by
anyio's own frame in the error's traceback. :func:`run_sync` carries the error across as a
value instead, and raises it from a frame that lets go of it.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio
import anyio.to_thread

__all__ = ["Outcome", "run_sync", "without_tracebacks"]

T = TypeVar("T")


class Outcome(Generic[T]):
    """What ``fn(*args)`` returned or raised, captured on one thread, raised on another."""

    __slots__ = ("__weakref__", "_error", "_result")

    def __init__(self) -> None:
        self._result: T | None = None
        self._error: BaseException | None = None

    @staticmethod
    def capture(into: weakref.ref[Outcome[T]], fn: Callable[..., T], *args: object) -> None:
        """``fn(*args)``'s outcome, kept in ``into()`` if its caller still holds it. Only
        weakly: the worker thread's frames (trio's wrap this call in a closure) are in the
        error's traceback, and would hold it in a cycle once the caller has left
        (``abandon_on_cancel``), when nobody unwraps it."""
        try:
            result = fn(*args)
        except BaseException as exc:  # raised by unwrap(), in the caller's task
            outcome = into()
            if outcome is not None:
                outcome._error = exc
            del outcome  # this frame is in the error's traceback
            return
        outcome = into()
        if outcome is not None:
            outcome._result = result

    async def capture_async(self, fn: Callable[..., Awaitable[T]], *args: object) -> Outcome[T]:
        """``await fn(*args)``, an ``Exception`` kept (cancellation goes on), for another
        thread to unwrap past the frames that carry it there (``anyio.from_thread.run``'s holds
        its future). It must be unwrapped: until then, its error's traceback holds it."""
        try:
            self._result = await fn(*args)
        except Exception as exc:
            self._error = exc
        return self

    def unwrap(self) -> T:
        """The result (None if nothing was captured), or the error raised; either is let go."""
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # this frame is in its traceback
        result, self._result = self._result, None
        return result  # type: ignore[return-value]


async def run_sync(
    fn: Callable[..., T],
    *args: object,
    limiter: anyio.CapacityLimiter | None = None,
    abandon_on_cancel: bool = False,
) -> T:
    """``anyio.to_thread.run_sync(fn, *args)``, its error raised without a cycle (above)."""
    outcome: Outcome[T] = Outcome()
    await anyio.to_thread.run_sync(
        Outcome.capture,
        weakref.ref(outcome),
        fn,
        *args,
        limiter=limiter,
        abandon_on_cancel=abandon_on_cancel,
    )
    return outcome.unwrap()


def without_tracebacks(error: T) -> T:
    """``error`` (an exception), its tracebacks and those of its causes and contexts dropped:
    for an error returned as a value, whose tracebacks would hold the frames that return it
    (a refusal in a list of batch results holds the batch)."""
    seen: set[int] = set()
    chain: list[object] = [error]
    while chain:
        link = chain.pop()
        if isinstance(link, BaseException) and id(link) not in seen:
            seen.add(id(link))
            link.__traceback__ = None
            chain += (link.__cause__, link.__context__)
    return error
