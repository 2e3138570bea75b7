"""A blocking portal on a daemon thread: how sync calls from plain threads reach async code.

``anyio.from_thread.start_blocking_portal`` runs its loop on a non-daemon thread, so a client
that is never closed would hang the interpreter at exit. This portal's thread is a daemon, and a
``weakref.finalize`` (which also runs at exit) stops it cleanly when the owner goes away.
"""

from __future__ import annotations

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
        async with BlockingPortal() as portal:
            self._portal = portal
            self._ready.set()
            await portal.sleep_until_stopped()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
        portal = self._portal
        if portal is None:
            raise RuntimeError("the portal is stopped")
        return portal.call(fn, *args)

    def stop(self) -> None:
        """Let running calls finish, then end the loop and its thread. Idempotent."""
        portal, self._portal = self._portal, None
        if portal is None or threading.current_thread() is self._thread:
            return
        with contextlib.suppress(RuntimeError):  # already stopped (e.g. at interpreter exit)
            portal.call(portal.stop, False)
        self._thread.join(timeout=10)
