"""The calling thread's OpenMP thread count, for one CPU forward pass at a time.

Why per thread: ``torch.set_num_threads`` changes the whole process (and the default of every
thread started later); libgomp's ``omp_set_num_threads`` changes only the calling thread's
count, which is what a forward pass that should leave cores to the decoding threads needs. It is
reached through ``ctypes`` in the libgomp that torch loaded (Linux builds of torch); elsewhere,
or with more than one OpenMP runtime loaded, :func:`thread_count` changes nothing.

Why it matters on a small CPU box (docs/benchmarks-history.md, "Session 4"): with a single OpenMP
team in the process, libgomp's workers spin for a long while between parallel regions (its default
``GOMP_SPINCOUNT``). That makes a forward pass of one tile fast (2.3 ms on 2 cores instead of 5.4
once they stop spinning), but while other threads decode the next batch, the spinning steals their
core: dynamic batching on 2 cores spent 4.4-5 ms of CPU a tile instead of 3.3-3.6.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["per_thread_counts_supported", "thread_count"]


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # Paths are bytes: surrogateescape gives them back to CDLL as they were (os.fsdecode's).
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
            paths = {
                line.split()[-1]
                for line in maps
                if line.rstrip().rsplit("/", 1)[-1].startswith("libgomp")
            }
    except OSError:
        return None
    if len(paths) != 1:  # none, or two copies: leave them alone
        return None
    try:
        function = ctypes.CDLL(paths.pop()).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = None
    return function  # type: ignore[no-any-return]


def per_thread_counts_supported() -> bool:
    """Can :func:`thread_count` change this process's OpenMP thread counts?"""
    return _omp_set_num_threads() is not None


@contextmanager
def thread_count(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` OpenMP threads on this thread (``None``: unchanged).

    Other threads, and torch's process-wide setting, are left alone; the thread's own count is
    restored afterwards.
    """
    setter = _omp_set_num_threads()
    if threads is None or setter is None:
        yield
        return
    # Also torch's per-thread first-use initialization, which would otherwise override ours.
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    setter(max(1, threads))
    try:
        yield
    finally:
        setter(previous)
