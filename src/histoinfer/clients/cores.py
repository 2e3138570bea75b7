"""``CoreShare``: how many CPU cores a dynamic client's forward pass leaves to its decoders.

On a CPU device the forward pass and the decode threads share the machine. torch runs a forward
pass on ``torch.get_num_threads()`` OpenMP threads (every core, by default), and with a single
OpenMP team in the process (models/device_thread.py) libgomp's workers spin for ~5 ms after
each parallel region: they hold every core for the whole pass and a little after, and a decode
thread running meanwhile gets its core in slices. On 2 cores that cost dynamic batching of the
tiny model 4.4-5 ms of CPU a tile instead of 3.3-3.6 (docs/benchmarks.md, "Session 4").

Leaving the decoders their cores (running the pass on fewer threads) only pays when decoding is
a real share of the work. Per tile, with ``t`` threads, ``k`` of them left, a forward pass
taking ``F`` at ``t`` threads and a decode taking ``D``: leaving costs the forward pass about
``F * k / (t - k)``; not leaving costs the decode about ``D`` or more (its core is taken by
spinning workers, which slow the pass's own thread too). So cores are left only while requests
are on their way (the pipeline is loaded) and ``F * k / (t - k) <= 3 D``: the tiny model on 2
cores (F ~1 ms, D ~1.4 ms) leaves one; ViT-S (F ~45 ms) never does; a 16-core box leaves one
core while ``F <= 45 D``. A lone request always gets every core.

Both costs are measured as the client runs, under load only (loaded forward passes, sharded
ones included; decode chunks of bodies that queued up, and decodes that start while the device
runs a pass: a lone request on an idle machine is faster than either), as decaying,
tile-weighted averages of wall time, so the choice follows the model and the machine. Until
both are known, cores are left: a pass on ``t - k`` threads costs at most ``t / (t - k)`` of
its time, while an OpenMP team beside busy decoders costs far more: on 2 cores, a pass of 1-15
tiles of the tiny model took 3-4.5x as long on both threads as on one beside two busy threads
(14 against 5 ms for one tile, 115 against 26 for 15), and the first pass of a burst, one tile,
58-208 ms (docs/benchmarks.md, "Session 8"). Wall times under load include the contention
itself, which favours what is already being done: a loaded tiny model measured F ~2.5-3 and D
~1.2-2 ms while not leaving (hence the slack of 3); once leaving, F ~1.0-1.3.
"""

from __future__ import annotations

import threading

__all__ = ["CoreShare"]

# How much of the past a new measurement leaves in the averages.
_DECAY = 0.8
# How much more the forward pass may lose than a decode gains. The estimate of what not leaving
# costs ("about D") is low: spinning workers slow the pass's own thread too, and a loaded pass
# on every core measures slow because of that very contention. Measured on 2 cores, tiny model:
# F ~2.5-3 ms a tile while not leaving (~1.0-1.3 once leaving), D ~1.2-2 ms; ViT-S: F ~45 ms.
# 2 D was too tight (some runs never started leaving); 3 D leaves for the one, never the other.
_SLACK = 3.0


class CoreShare:
    """The forward pass's and the decoders' measured costs, and the split they imply.

    Thread-safe: decode threads and the device thread record, the device thread asks.
    """

    def __init__(self, decode_threads: int) -> None:
        self.decode_threads = decode_threads
        self._lock = threading.Lock()
        self._decode = _PerTile()  # one decode thread
        self._forward = _PerTile()  # normalized to every thread

    def record_decode(self, tiles: int, seconds: float) -> None:
        with self._lock:
            self._decode.add(tiles, seconds)

    def record_forward(self, tiles: int, seconds: float, threads: int, all_threads: int) -> None:
        """A loaded forward pass of ``tiles`` took ``seconds`` on ``threads`` of ``all_threads``.

        Only loaded passes are recorded: those are the ones the choice is for, and a lone
        pass's cost per tile says little about a batch's (the tiny model: ~2.3 ms for one tile
        alone, ~1 ms a tile in a batch of 50)."""
        if all_threads > 0:
            # Normalized to every thread, assuming the pass scales with its threads (it nearly
            # does for batches: 98 vs 49 ms for 51 tiles of the tiny model on 1 and 2 threads).
            with self._lock:
                self._forward.add(tiles, seconds * threads / all_threads)

    def cores_to_leave(self, all_threads: int) -> int:
        """Threads a loaded forward pass (requests are on their way: queued for the next batch,
        or still being decoded) should leave free. A lone pass is not asked: it gets them all.
        Until both costs are known, the decoders' cores (module docstring)."""
        leave = min(self.decode_threads, all_threads - 1)
        if leave <= 0:
            return 0
        with self._lock:
            forward, decode = self._forward.per_tile(), self._decode.per_tile()
        if forward is None or decode is None:
            return leave
        return leave if forward * leave / (all_threads - leave) <= _SLACK * decode else 0


class _PerTile:
    """Seconds per tile over recent calls, weighted by their tiles: the first loaded pass of a
    burst is often one tile, slow on a busy machine (20-34 ms for the tiny model), and must not
    outweigh the batches of 50 that follow."""

    __slots__ = ("seconds", "tiles")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tiles = 0.0

    def add(self, tiles: int, seconds: float) -> None:
        if tiles > 0:
            self.seconds = self.seconds * _DECAY + seconds
            self.tiles = self.tiles * _DECAY + tiles

    def per_tile(self) -> float | None:
        return self.seconds / self.tiles if self.tiles else None
