"""``DeviceThread``: one long-lived thread per device that runs every forward pass on it.

Why one thread, and not whichever worker thread is free: torch's CPU kernels run on OpenMP
(libgomp), and libgomp keeps a team of worker threads for *each* thread that has run a parallel
op. Once a process holds more OpenMP threads than CPUs, every team stops spin-waiting between
parallel regions (``GOMP_SPINCOUNT`` 300,000 -> 100) and each region pays a futex wake-up: a
forward pass of one tile of the tiny model took 5.4 ms instead of 2.4 on 2 cores
(docs/benchmarks-history.md, "OpenMP regimes"). Forward passes that land on arbitrary worker threads
(anyio's, the decode threads', the thread that loaded the model) leave a team on each of them.
Running the load-time probe and every forward pass of the clients on this one thread leaves one
team per device, whatever else the process does.

It also serializes the device's forward passes (SPEC §5): in the order they were submitted, and
under the thread's lock even when one runs elsewhere (a job submitted from a job, or after
``stop`` at interpreter exit, runs in the submitting thread).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from ..errors import ThreadAbortedError

__all__ = ["DeviceThread", "device_key", "device_thread", "helper_threads", "one_cpu"]

R = TypeVar("R")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
_STOP: Any = object()  # the job that ends the thread

#: Longest the interpreter's exit waits for a forward pass in progress (see ``stop``).
EXIT_TIMEOUT_S = 60.0


class DeviceThread:
    """Runs submitted functions one at a time, in order, on one daemon thread.

    The thread starts on first use and lives as long as the process (it is idle, blocked on its
    queue, between jobs). A function that raises fails only its own future.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # One job at a time, wherever it runs; reentrant: a job may submit another.
        self._running = threading.RLock()
        self._stopped = False
        self._unfinished = 0  # jobs submitted and not yet done
        self._count_lock = threading.Lock()

    @property
    def idle(self) -> bool:
        """No job queued or running (a moment stale: a hint for scheduling, not a lock)."""
        return self._unfinished == 0

    @property
    def ident(self) -> int | None:
        """The thread's identifier, once started."""
        return None if self._thread is None else self._thread.ident

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """Queue ``fn(*args)``; its future completes on the device thread."""
        future: Future[R] = Future()
        if threading.current_thread() is self._thread or self._stopped:
            # A job that submits another (directly or through a client) would wait for itself;
            # after stop() (the interpreter is exiting) the caller's thread does the work.
            self._run(future, fn, args)
            return future
        self._ensure_started()
        with self._count_lock:
            self._unfinished += 1
        future.add_done_callback(self._job_done)
        self._jobs.put((future, fn, args))
        return future

    def _job_done(self, _: Future[Any]) -> None:
        with self._count_lock:
            self._unfinished -= 1

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(*args)`` on the device thread and return its result (or raise its error)."""
        return self.submit(fn, *args).result()

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                thread.start()
                self._thread = thread

    def stop(self, timeout: float | None = None) -> None:
        """Run the jobs already queued, then end the thread (any that race in behind the stop
        are cancelled).

        Called at interpreter exit: the thread is a daemon, and a daemon thread still inside
        torch when the process exits aborts it ("terminate called without an active
        exception", exit status 134) — e.g. when a script's main thread raises while a batch
        runs. Later submissions run in the caller's thread.
        """
        self._stopped = True
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        self._jobs.put((Future(), _STOP, ()))
        thread.join(timeout)

    def _run(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with self._running:
                result = fn(*args)
        except BaseException as exc:  # the future carries it to the caller; the thread lives on
            future.set_exception(ThreadAbortedError.contain(exc, f"a job on thread {self.name!r}"))
            del future  # the error's traceback holds this frame: no cycle (histoinfer/outcome.py)
        else:
            future.set_result(result)

    def _serve(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if fn is _STOP:
                break
            self._run(future, fn, args)
            del future, fn, args  # drop the job's references while idle
        while True:  # stopped: nobody will run what is left
            try:
                future, fn, args = self._jobs.get_nowait()
            except queue.Empty:
                return
            future.cancel()


_THREADS: dict[str, DeviceThread] = {}
_THREADS_GUARD = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: the parent's threads are not here (the child makes its own as it
    needs them), nor stopped at its exit; and a parent thread may have held the guard."""
    global _THREADS_GUARD
    _THREADS_GUARD = threading.Lock()
    _THREADS.clear()


if hasattr(os, "register_at_fork"):  # no fork, nothing to forget (Windows)
    os.register_at_fork(after_in_child=_forget_after_fork)


def device_thread(device: torch.device | str) -> DeviceThread:
    """The process's forward thread for ``device`` (one per device: ``cuda`` and ``cuda:0``
    are one device when 0 is the current one)."""
    return _registered(device_key(device))


def helper_threads(device: torch.device | str, count: int) -> list[DeviceThread]:
    """``count`` threads that help ``device``'s thread run the shards of one CPU forward pass
    (models/shards.py); only that thread submits to them."""
    key = device_key(device)
    return [_registered(f"{key}/helper-{i}") for i in range(1, count + 1)]


def one_cpu(device: torch.device) -> torch.device:
    """``device``, with any CPU index dropped: torch runs ``cpu:0`` and ``cpu:7`` on the one
    CPU, and here they must share its forward thread and be named alike."""
    return torch.device("cpu") if device.type == "cpu" else device


def device_key(device: torch.device | str) -> str:
    """``device`` named with its index: a bare ``cuda`` means the current CUDA device, and
    every CPU index the one CPU."""
    resolved = one_cpu(torch.device(device))
    if resolved.type == "cpu" or resolved.index is not None:
        return str(resolved)
    cuda = resolved.type == "cuda" and torch.cuda.is_available()
    index = torch.cuda.current_device() if cuda else 0
    return f"{resolved.type}:{index}"


def _registered(key: str) -> DeviceThread:
    with _THREADS_GUARD:
        thread = _THREADS.get(key)
        if thread is None:
            thread = _THREADS[key] = DeviceThread(f"histoinfer-device-{key}")
        return thread


@atexit.register
def _stop_all() -> None:
    """At exit, let each device thread finish its forward pass (see ``DeviceThread.stop``)."""
    with _THREADS_GUARD:
        threads = list(_THREADS.values())
    for thread in threads:
        thread.stop(EXIT_TIMEOUT_S)
