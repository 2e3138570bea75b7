"""Giving a burst's memory back to the system once the server is idle again.

A burst of requests holds their bodies and decoded tiles at once (2,000 at once: ~550 MB over
an idle server's ~360 MB). Freed, that memory stays with glibc's allocator (in the arenas of
the threads that decoded it), so the process kept ~3x its idle size for ever after, though
nothing used it (a soak trial: 911 MB, where ``malloc_trim(0)`` brought it back to 393). While
no request is in flight, and the process has grown since the last look, the server asks glibc
to return what it holds free. Nowhere else (musl, macOS, Windows) is there such a call, nor a
need to find one: this does nothing there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable

import anyio

__all__ = ["return_freed_memory"]

log = logging.getLogger("histoinfer.server")

#: how often an idle server looks whether it has grown
CHECK_EVERY_S = 5.0
#: growth since the last trim worth a trim (an idle server's noise is a few MB)
WORTH_TRIMMING = 64 * 1024 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):  # (Windows' CDLL(None) raises TypeError)
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl
        return None
    return trim


def _resident_bytes() -> int | None:
    """The process's resident memory, or None where ``/proc`` does not say."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


async def return_freed_memory(
    idle: Callable[[], bool],
    *,
    trim: Callable[[int], int] | None = None,
    resident: Callable[[], int | None] = _resident_bytes,
    every: float = CHECK_EVERY_S,
) -> None:
    """Until cancelled: every ``every`` seconds, if ``idle()`` and the process has grown by
    :data:`WORTH_TRIMMING` since the last trim, ``trim(0)`` on a worker thread (it walks the
    heap: tens of ms for a GB)."""
    trim = trim or _malloc_trim()
    start = resident()
    if trim is None or start is None:
        return
    floor = start
    while True:
        await anyio.sleep(every)
        now = resident()
        if now is None or now - floor < WORTH_TRIMMING or not idle():
            continue
        await anyio.to_thread.run_sync(trim, 0)
        after = resident() or now
        log.debug(
            "idle: %d MB returned to the system (%d MB resident)", (now - after) >> 20, after >> 20
        )
        floor = after
