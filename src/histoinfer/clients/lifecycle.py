"""What every backend's lifecycle shares: the context-manager half of the ``Client`` protocol,
and the count of calls in flight that ``close()`` waits for.

A backend implements ``close()`` and ``aclose()``; ``with`` and ``async with`` call them.
Torch-free on purpose: ``HttpClient`` uses it too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Self

import anyio
import sniffio

from ..errors import ClientClosedError

__all__ = ["ClosingContext", "InFlight", "running_loop_here"]


class InFlight:
    """The calls in flight of one client, and whether it is closed (SPEC §5: closing finishes
    the work in flight and refuses new calls with :class:`ClientClosedError`). Thread-safe."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._active = 0
        self.closed = False

    @property
    def active(self) -> int:
        """Calls in flight (a moment stale)."""
        return self._active

    @contextmanager
    def call(self) -> Iterator[None]:
        """One call: refused once closed; counted while it runs."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def enter(self) -> None:
        with self._idle:
            if self.closed:
                raise ClientClosedError("the client is closed")
            self._active += 1

    def exit(self) -> bool:
        """End a call; True if it was the last one in flight of a closed client."""
        with self._idle:
            self._active -= 1
            if self._active:
                return False
            self._idle.notify_all()
            return self.closed

    def close(self) -> bool:
        """Refuse new calls; True if none is in flight."""
        with self._idle:
            self.closed = True
            return self._active == 0

    def wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._active == 0)

    async def wait_idle_async(self) -> None:
        """:meth:`wait_idle` for ``aclose()``: cancellable, and this loop keeps running its own
        calls meanwhile. (Calls end on any thread or loop, so it looks every few ms.)"""
        while self._active:
            await anyio.sleep(0.005)


def running_loop_here() -> bool:
    """Is an event loop running on this thread (also outside a task, e.g. in a callback)?
    ``close()`` must not wait there: it would block the loop whose calls it waits for."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return False
    return True


class ClosingContext:
    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
