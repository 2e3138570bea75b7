"""One thread per device runs every forward pass on that device.

Why a thread of its own: torch's CPU ops run on OpenMP, and libgomp keeps a thread team for
every thread that starts a parallel region. Once more threads are in teams than there are
cores, it stops spinning between regions and every op pays a futex wake-up: on 2 cores a
batch-of-1 forward pass of the tiny model took 3.9 ms instead of 1.7 ms while forward passes
had run on a few different worker threads (docs/benchmarks.md). One thread per device keeps one
team, and also makes "one forward pass at a time per device" hold by construction, across
event loops, threads and clients. (On a GPU it keeps one CUDA context per device in use.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["DeviceThread", "device_thread"]

P = ParamSpec("P")
T = TypeVar("T")


class DeviceThread:
    """A single worker thread that runs functions for one device, one at a time, in order."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._ident: int | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"histoinfer-device-{device}",
            initializer=self._remember_ident,
        )

    def _remember_ident(self) -> None:
        self._ident = threading.get_ident()

    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the device thread; blocks until it returns or raises.

        Called from the device thread itself (a forward pass that runs another), it runs inline
        instead of waiting for itself.
        """
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        return self._executor.submit(fn, *args, **kwargs).result()


_THREADS: dict[str, DeviceThread] = {}
_GUARD = threading.Lock()


def device_thread(device: object) -> DeviceThread:
    """The process-wide thread of ``device`` (a ``torch.device`` or its string)."""
    key = str(device)
    with _GUARD:
        thread = _THREADS.get(key)
        if thread is None:
            thread = _THREADS[key] = DeviceThread(key)
        return thread
