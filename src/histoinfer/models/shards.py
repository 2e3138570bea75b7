"""Sharded CPU forward passes: one batch, run as parts on single-threaded workers.

Why: torch runs a CPU forward pass on OpenMP threads that meet at a barrier after every op.
On a small box that wastes cores twice over. The team is ~84% efficient (the tiny model: 1.02 ms
of wall time a tile on 2 threads, i.e. 2.04 ms of CPU, against 1.72 ms on one), and with a
single OpenMP team in the process (models/device_thread.py) its workers spin for ~5 ms after
every region, holding the cores the decode threads need. Splitting the batch into parts that
run whole on single-threaded workers, each pulling the next part when it is done, needs no
barrier and no spinning: the parts' threads and the decoders share the cores through the OS
scheduler, and nothing spins while another thread waits for a core. Measured on 2 cores
(docs/benchmarks-history.md, "Session 5"): a batch of 64 alone 0.92-0.98 ms a tile against 1.02-1.12
with OpenMP; dynamic batching of the tiny model +9-15%, 1.20-1.22x the (also sharded) explicit
loop where it was 1.11-1.15x; the small model (ViT-S) +14-18% on every path.

It is still one forward pass (SPEC §5: one at a time per device): the device's thread runs it,
works on its parts itself, and returns only once every helper is done with the others. Every
batch of two tiles or more is sharded: one part per worker, up to two per worker once parts of
``MIN_PART_TILES`` fit. Small batches too (session 16), because what the team costs them comes
after the pass: its workers spin ~5 ms after it on the core a decoder needs just then, when the
callers of a small batch come back with their next requests. At 4 and 8 callers in flight that
made dynamic batching 0.7-0.97x the explicit loop; sharded, a pass of 2-15 tiles takes about the
team's time (0.95-1.05x for an even count, 1.07-1.17x for 3 or 5 tiles on 2 workers) and dynamic
batching at 8 in flight went from 340 to 407 tiles/s side by side (docs/benchmarks-history.md,
"Session 16"; measured on 2 threads only, as the rest of this rule). A lone tile keeps torch's
threads, which is what makes a lone request fast. Boxes with more than
``MAX_WORKERS`` torch threads keep torch's threads too: many single-threaded parts would queue
for the GIL, which the program's Python holds between ops, and it has not been measured there.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import wait

import torch

from ..schema import Mode
from .base import BatchOutput, ServerModel
from .device_thread import helper_threads
from .openmp import per_thread_counts_supported, thread_count

__all__ = ["MAX_WORKERS", "MIN_PART_TILES", "available", "describe", "forward", "plan"]

#: Fewest tiles in a part before a worker gets two: a part of 8 of the tiny model runs at ~the
#: per-tile cost of 32; smaller batches run as one part per worker.
MIN_PART_TILES = 8
#: Most workers (the device's thread included) a pass is split across.
MAX_WORKERS = 4
# Parts per worker: more than one lets a worker whose core was taken by a decoder do less.
_PARTS_PER_WORKER = 2

Tiles = torch.Tensor | Sequence[torch.Tensor]


def available(model: ServerModel, threads: int) -> bool:
    """Whether passes of 2+ tiles of ``model`` with ``threads`` torch threads are sharded."""
    return model.device.type == "cpu" and model.shardable and _machine_allows(threads)


def describe(threads: int) -> str:
    """How CPU forward passes of a ``torch.export`` model run here, for reports."""
    if _machine_allows(threads):
        return (
            f"batches of 2+ tiles sharded across up to {threads} single-threaded workers, "
            "a lone tile on torch's threads"
        )
    if 2 <= threads <= MAX_WORKERS:
        why = "OpenMP runtime not libgomp"
    else:
        why = f"{threads} thread{'' if threads == 1 else 's'}"
    return f"on torch's threads (not sharded: {why})"


def _machine_allows(threads: int) -> bool:
    # libgomp's per-thread counts, else each part would run on every core.
    return 2 <= threads <= MAX_WORKERS and per_thread_counts_supported()


def plan(model: ServerModel, tiles: int, threads: int) -> tuple[int, int]:
    """``(workers, part_size)`` for a pass of ``tiles`` of ``model`` with ``threads`` torch
    threads; ``workers == 1``: not sharded (torch's threads run the whole batch)."""
    if tiles < 2 or not available(model, threads):
        return 1, tiles
    workers = min(threads, tiles)
    # One part per worker; more (up to two a worker) once parts of MIN_PART_TILES fit: a worker
    # whose core a decoder took then does less. As even as they come (17 tiles: 9 + 8, not
    # 8 + 8 + 1). Rounding may leave a worker without a part (5 tiles on 4 threads: 2 + 2 + 1).
    parts = max(workers, min(workers * _PARTS_PER_WORKER, tiles // MIN_PART_TILES))
    size = -(-tiles // parts)
    return min(workers, -(-tiles // size)), size


def forward(
    model: ServerModel, tiles: Tiles, mode: Mode, threads: int | None = None
) -> BatchOutput:
    """One forward pass over ``tiles`` (a stacked ``uint8`` batch or a list of tiles), on the
    device's thread: sharded where :func:`plan` says so, else in one piece.

    ``threads``: the torch threads the pass may use (default: this thread's count). A list goes
    to ``ServerModel.forward_tiles`` part by part, on the workers (no stacked copy)."""
    if threads is None:
        threads = torch.get_num_threads()
    workers, size = plan(model, len(tiles), threads)
    if workers == 1:
        return _forward_part(model, tiles, slice(None), mode)
    parts = [slice(start, start + size) for start in range(0, len(tiles), size)]
    outputs: list[BatchOutput | None] = [None] * len(parts)
    claim = _Claims(len(parts))

    def work() -> None:
        with thread_count(1):
            while (index := claim.next()) is not None:
                try:
                    outputs[index] = _forward_part(model, tiles, parts[index], mode)
                except BaseException:
                    claim.stop()  # the others take no new part: the pass has failed
                    raise

    helpers = [thread.submit(work) for thread in helper_threads(model.device, workers - 1)]
    try:
        work()
    finally:
        wait(helpers)  # never return while a helper still runs this pass
    for helper in helpers:
        helper.result()  # a helper's error, as the pass's
    done = [out for out in outputs if out is not None]
    if len(done) != len(parts):  # pragma: no cover - every part ran, or the pass raised
        raise RuntimeError(f"a sharded forward pass ran {len(done)} of {len(parts)} parts")
    return BatchOutput.concat(done)


def _forward_part(model: ServerModel, tiles: Tiles, part: slice, mode: Mode) -> BatchOutput:
    if isinstance(tiles, torch.Tensor):
        return model.forward_batch(tiles[part], mode)
    return model.forward_tiles(tiles[part], mode)  # no stacked copy (ServerModel.forward_tiles)


class _Claims:
    """Hands out part indices, each once, until they run out or the pass fails."""

    def __init__(self, parts: int) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._parts = parts

    def next(self) -> int | None:
        with self._lock:
            if self._next >= self._parts:
                return None
            self._next += 1
            return self._next - 1

    def stop(self) -> None:
        with self._lock:
            self._next = self._parts
