"""A blocking portal on a daemon thread: how sync calls from plain threads reach async code.

``anyio.from_thread.start_blocking_portal`` runs its loop on a non-daemon thread, so a client
that is never closed would hang the interpreter at exit. This portal's thread is a daemon, and
its owner stops it cleanly when it closes, is dropped, or the interpreter exits.

``stop()`` may be called from any thread, including the portal's own (a garbage-collection
finalizer can run there): it asks the loop to stop with a thread-safe callback rather than a
portal call, which the portal refuses from its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
from anyio.from_thread import BlockingPortal

__all__ = ["PortalThread"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class PortalThread:
    """An asyncio event loop on a daemon thread, reachable from any thread via ``call``."""

    def __init__(self, name: str = "histoinfer-portal") -> None:
        self._ready = threading.Event()
        self._portal: BlockingPortal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # pragma: no cover - loop failed to start
            raise RuntimeError("could not start the blocking portal") from self._error

    def _main(self) -> None:
        try:
            anyio.run(self._serve, backend="asyncio")
        except BaseException as exc:  # pragma: no cover
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        # Leaving the block stops the portal and waits for the calls already running.
        async with BlockingPortal() as portal:
            self._portal = portal
            self._ready.set()
            await self._stop_requested.wait()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
        portal = self._portal
        if portal is None:
            raise RuntimeError("the portal is stopped")
        return portal.call(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Let running calls finish, then end the loop and (unless called from it) join its
        thread, for at most ``timeout`` seconds. Idempotent; never raises.
        """
        portal, self._portal = self._portal, None
        loop, stop_requested = self._loop, self._stop_requested
        if portal is None or loop is None or stop_requested is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(stop_requested.set)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
