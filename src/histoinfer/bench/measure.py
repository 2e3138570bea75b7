"""What one measurement is, and the closed-loop drivers that take one.

A measurement sends ``n`` bodies with ``c`` requests in flight (closed loop: each of ``c``
workers sends its next body as soon as its previous response arrives) and records the wall time,
every request's latency, and, where the path can tell, how many batches ran and how long the
forward pass was busy.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import anyio

__all__ = [
    "CPU_ROLES",
    "NATIVE_THREAD",
    "OUTPUT_TOLERANCE",
    "Expected",
    "Sample",
    "ThreadClock",
    "check_responses",
    "closed_loop_latencies",
    "cpu_split",
    "drive_async",
    "drive_threads",
    "percentile",
    "thread_cpu_clocks",
]

#: What a measurement's CPU is split into: ``forward`` (the device's thread and its helpers,
#: and on Linux torch's own OpenMP workers: the forward passes), ``main`` (the main thread: the
#: event loop of an async path, the caller of the explicit loop), ``other`` (every other thread
#: of the process: decoding, sync callers, the peers' decode threads; threads that ended in the
#: measurement count here too) and ``server`` (the server process of the HTTP path). Why: two
#: paths that run the same steps differ in where their extra CPU goes; the total does not say.
CPU_ROLES = ("forward", "main", "other", "server")
_FORWARD_THREADS = "histoinfer-device"


@dataclass(frozen=True)
class Sample:
    """One measurement of one path at one concurrency level."""

    tiles: int
    wall_s: float
    latencies_s: list[float]
    batches: int | None = None
    samples: int | None = None
    forward_busy_s: float | None = None
    #: CPU seconds spent (every thread of this process, plus a server process if any)
    cpu_s: float | None = None
    #: ``cpu_s`` by role (``CPU_ROLES``), where this platform has per-thread CPU clocks
    cpu_split_s: dict[str, float] | None = None

    @property
    def throughput(self) -> float:
        return self.tiles / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_batch_size(self) -> float | None:
        if not self.batches or self.samples is None:
            return None
        return self.samples / self.batches

    @property
    def cpu_ms_per_tile(self) -> float | None:
        return None if self.cpu_s is None else 1000.0 * self.cpu_s / self.tiles

    def cpu_ms_per_tile_of(self, role: str) -> float | None:
        if self.cpu_split_s is None or role not in self.cpu_split_s:
            return None
        return 1000.0 * self.cpu_split_s[role] / self.tiles

    @property
    def busy_share(self) -> float | None:
        """The forward pass's time over the wall time. Not clamped: passes run one at a time,
        so a share above 1 would be a measuring bug, and is shown as one."""
        if self.forward_busy_s is None or self.wall_s <= 0:
            return None
        return self.forward_busy_s / self.wall_s


#: The name given to threads Python does not know (torch's OpenMP workers, on Linux).
NATIVE_THREAD = ""


class ThreadClock(NamedTuple):
    """One thread's CPU clock at one moment, and what tells it from a later thread of its id."""

    name: str
    cpu_s: float
    #: when the thread started (Linux: clock ticks since boot); Python's ident elsewhere
    started: int


def _linux_thread_clock(tid: int) -> tuple[float, int]:
    # Linux's per-thread CPU clock id for any thread of this process (MAKE_THREAD_CPUCLOCK),
    # and the thread's start time (field 22 of its stat; the name before it may hold spaces).
    with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
        started = int(stat.read().rpartition(b")")[2].split()[19])
    return time.clock_gettime((~tid << 3) | 6), started


def thread_cpu_clocks() -> dict[int, ThreadClock] | None:
    """Every thread's CPU clock, by native thread id; None where that cannot be read.

    On Linux every thread of the process counts, including the ones Python does not know
    (torch's OpenMP workers, named ``NATIVE_THREAD``): a forward pass on torch's team runs
    there. Elsewhere, Python's threads only.
    """
    named = {t.native_id: t for t in threading.enumerate() if t.native_id is not None}
    clocks = {}
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    if tids and sys.platform == "linux":
        for tid in tids:
            thread = named.get(tid)
            try:
                cpu_s, started = _linux_thread_clock(tid)
            except (OSError, ValueError, IndexError):  # it ended since the listing
                continue
            clocks[tid] = ThreadClock(thread.name if thread else NATIVE_THREAD, cpu_s, started)
        return clocks
    getclock = getattr(time, "pthread_getcpuclockid", None)
    if getclock is None:
        return None
    for tid, thread in named.items():
        try:
            cpu_s = time.clock_gettime(getclock(thread.ident))
        except (OSError, ValueError, OverflowError, TypeError):  # it ended meanwhile
            continue
        clocks[tid] = ThreadClock(thread.name, cpu_s, thread.ident or 0)
    return clocks


def cpu_split(
    before: dict[int, ThreadClock] | None,
    after: dict[int, ThreadClock] | None,
    process_s: float,
    server_s: float | None = None,
    main_thread: int | None = None,
) -> dict[str, float] | None:
    """A measurement's CPU by role (``CPU_ROLES``), from thread clocks taken around it.

    ``process_s`` is this process's CPU over the same span; what the live threads' clocks do
    not account for (threads that ended meanwhile) counts as ``other``. ``main_thread``: the
    native id of the thread that counts as ``main`` (a path's event loop in a thread of its
    own), by default the process's main thread.
    """
    if before is None or after is None:
        return None
    main = threading.main_thread().native_id if main_thread is None else main_thread
    split = {"forward": 0.0, "main": 0.0}
    for tid, now in after.items():
        then = before.get(tid)
        if then is not None and then.started == now.started and then.cpu_s <= now.cpu_s:
            # A Python thread that is ending is no longer listed by name: it keeps its old one.
            spent, name = now.cpu_s - then.cpu_s, now.name or then.name
        else:  # started meanwhile: all of it counts, even with an ended thread's id
            spent, name = now.cpu_s, now.name
        if tid == main:
            split["main"] += spent
        elif name == NATIVE_THREAD or name.startswith(_FORWARD_THREADS):
            split["forward"] += spent
    split["other"] = max(process_s - split["forward"] - split["main"], 0.0)
    if server_s is not None:
        split["server"] = server_s
    return split


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank: the smallest value with at least ``q`` of the
    values at or below it (the ``ceil(q * n)``-th smallest); 0.0 for no values.

    Of fewer than 100 values, p99 is therefore the largest: one slow call."""
    if not values:
        return 0.0
    data = sorted(values)
    # The 1e-9 keeps q * n = 19.000000000000004 (0.95 * 20 in floats) at rank 19.
    rank = math.ceil(q * len(data) - 1e-9)
    return data[min(len(data), max(rank, 1)) - 1]


def closed_loop_latencies(started: float, done: Sequence[float], concurrency: int) -> list[float]:
    """Each request's latency as ``concurrency`` closed-loop callers would see it, for a path
    that answers in chunks (the raw forward, the explicit loop): request ``i`` is sent when
    request ``i - concurrency`` is answered (the first ``concurrency`` at ``started``) and
    answered at ``done[i]``, the end of its chunk.

    So a request waiting behind earlier chunks counts its wait, as it does on every path that
    ``drive_async`` or ``drive_threads`` measures; timing the request's own chunk alone made
    the chunked paths' tail look several times shorter than the batchers' (session 21)."""
    return [
        end - (started if i < concurrency else done[i - concurrency]) for i, end in enumerate(done)
    ]


def p50_ms(latencies: Sequence[float]) -> float:
    return percentile(latencies, 0.5) * 1000.0


_PATCH_IDX = re.compile(r'"patch_idx":\s*(\d+)')

#: How far a response's numbers may be from the same tile's, run alone, in float32, relative
#: to the largest of them where that is over 1: the CPU kernels sum in another order at
#: another batch size (~1e-7 seen), and two of the bench's tiles differ by at least ~8e-3
#: (the tiny model's predictions). Relative, for a model of the user's own whose outputs are
#: in the thousands (``bench --checkpoint``): 1e-4 absolute failed one that answered within
#: 5e-6 of its scale (a review).
OUTPUT_TOLERANCE = 1e-4

#: A tile's expected response numbers, by response field (``output``, ``embedding``)
Expected = dict[str, list[float]]


def check_responses(
    responses: Sequence[str | None], path: str, expected: Mapping[int, Expected] | None = None
) -> None:
    """Every response is there and answers its own request (body ``i`` has ``patch_idx == i``),
    and those to the bodies in ``expected`` carry the numbers of their own tile, run alone
    (rows crossed inside a batch would keep their ``patch_idx``, which comes from the request).

    A benchmark that loses or crosses responses measures nothing: this runs after every
    measurement, outside the timed section.
    """
    for i, response in enumerate(responses):
        if response is None:
            raise RuntimeError(f"{path}: request {i} got no response")
        match = _PATCH_IDX.search(response)
        if match is None or int(match.group(1)) != i:
            raise RuntimeError(f"{path}: response {i} does not answer request {i}")
    for i, fields in (expected or {}).items():
        if i >= len(responses):
            continue
        got = json.loads(responses[i] or "{}")
        for name, values in fields.items():
            off = _farthest(got.get(name), values)
            scale = max([1.0, *map(abs, values)])
            if not off <= OUTPUT_TOLERANCE * scale:  # NaN too
                raise RuntimeError(
                    f"{path}: response {i}'s {name!r} is not its tile's: {off:.2g} away from "
                    "the same tile run alone"
                )


def _farthest(got: object, expected: list[float]) -> float:
    """The largest difference between two lists of numbers (infinite if they do not match)."""
    if not isinstance(got, list) or len(got) != len(expected):
        return math.inf
    return max((abs(a - b) for a, b in zip(got, expected, strict=True)), default=0.0)


async def drive_async(
    call: Callable[[str], Awaitable[str]], bodies: Sequence[str], concurrency: int
) -> tuple[float, list[float], list[str | None]]:
    """Send every body through ``call`` with ``concurrency`` in flight; on the running loop."""
    n = len(bodies)
    latencies = [0.0] * n
    responses: list[str | None] = [None] * n
    next_index = 0
    clock = time.perf_counter

    async def worker() -> None:
        nonlocal next_index
        while next_index < n:
            i = next_index
            next_index += 1
            started = clock()
            responses[i] = await call(bodies[i])
            latencies[i] = clock() - started

    started = clock()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, n)):
            tg.start_soon(worker)
    return clock() - started, latencies, responses


def drive_threads(
    call: Callable[[str], str], bodies: Sequence[str], concurrency: int
) -> tuple[float, list[float], list[str | None]]:
    """Send every body through blocking ``call`` from ``concurrency`` threads.

    The threads are started before the clock starts and released together, so thread creation
    is not measured.
    """
    n = len(bodies)
    latencies = [0.0] * n
    responses: list[str | None] = [None] * n
    indices = iter(range(n))
    lock = threading.Lock()
    go = threading.Event()
    errors: list[BaseException] = []
    clock = time.perf_counter

    def worker() -> None:
        go.wait()
        while True:
            with lock:
                i = next(indices, None)
            if i is None:
                return
            started = clock()
            try:
                responses[i] = call(bodies[i])
            except BaseException as exc:
                errors.append(exc)
                return
            latencies[i] = clock() - started

    threads = [
        threading.Thread(target=worker, name=f"bench-sync-{k}", daemon=True)
        for k in range(min(concurrency, n))
    ]
    for thread in threads:
        thread.start()
    started = clock()
    go.set()
    for thread in threads:
        thread.join()
    wall = clock() - started
    if errors:
        raise errors[0]
    return wall, latencies, responses
