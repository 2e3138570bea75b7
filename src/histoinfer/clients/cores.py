"""``CoreShare``: how many CPU cores a dynamic client's forward pass leaves to its decoders.

On a CPU device the forward pass and the decode threads share the machine. torch runs a forward
pass on ``torch.get_num_threads()`` OpenMP threads (every core, by default), and with a single
OpenMP team in the process (models/device_thread.py) libgomp's workers spin for ~5 ms after
each parallel region: they hold every core for the whole pass and a little after, and a decode
thread running meanwhile gets its core in slices. On 2 cores that cost dynamic batching of the
tiny model 4.4-5 ms of CPU a tile instead of 3.3-3.6 (docs/benchmarks-history.md, "Session 4").

Leaving the decoders their cores (running the pass on fewer threads) only pays when decoding is
a real share of the work. Per tile, with ``t`` threads, ``k`` of them left, a forward pass
taking ``F`` at ``t`` threads and a decode taking ``D``: leaving costs the forward pass about
``F * k / (t - k)``; not leaving costs the decode about ``D`` or more (its core is taken by
spinning workers, which slow the pass's own thread too). So cores are left only while requests
are on their way (the pipeline is loaded) and ``F * k / (t - k) <= 6 D``: the tiny model on 2
cores (F ~1-4 ms, D ~1-2 ms) leaves one; ViT-S (F ~40-50 ms) never does; a 16-core box leaves
one core while ``F <= 90 D``. A lone request always gets every core. Where CPU passes are
sharded (models/shards.py: 2-4 torch threads), only passes of one tile are asked: sharded
parts run single-threaded and spin nowhere.

Both costs are measured as the client runs, under load only (loaded forward passes that ran
sharded or left cores; decode chunks of bodies that queued up, and decodes that start while the
device runs a pass: a lone request on an idle machine is faster than either), as decaying,
tile-weighted averages of wall time, so the choice follows the model and the machine. Until
both are known, cores are left: a pass on ``t - k`` threads costs at most ``t / (t - k)`` of
its time, while an OpenMP team beside busy decoders costs far more: on 2 cores, a pass of 1-15
tiles of the tiny model took 3-4.5x as long on both threads as on one beside two busy threads
(14 against 5 ms for one tile, 115 against 26 for 15), and the first pass of a burst, one tile,
58-208 ms (docs/benchmarks-history.md, "Session 8"). A loaded pass on torch's whole team is not
recorded: beside busy decoders its wall time is that very contention (a tile of the tiny model
at batch size 1 measured 14-100 ms), and counted, it made the choice stick to the team for good
once made. Wall times under load still include some contention (hence the slack, ``_SLACK``).
"""

from __future__ import annotations

import threading

__all__ = ["CoreShare"]

# How much of the past a new measurement leaves in the averages.
_DECAY = 0.8
# How much more the forward pass may lose than a decode gains. The estimate of what not leaving
# costs ("about D") is low: beside busy decoders the team itself is 3-13x slower (2 cores,
# tiny model and ViT-S alike). Measured on 2 cores while leaving: the tiny model F ~1.0-4.2 ms
# a tile (batch-size-1 passes the most), D ~1-2; ViT-S F ~37-50, D ~1.7. 3 D (the bound while
# F was measured on the team) left the tiny model's batch-size-1 passes only some of the time;
# 6 D leaves for the one, never the other, and breaks even near a pass 5-6x its decode, where
# decoders are busy a sixth of a pass.
_SLACK = 6.0
# While loaded passes keep every core, one in this many leaves the decoders' anyway: their cost
# is learned only from passes that leave, so one slow measurement would otherwise keep the
# choice for good. A heavy model pays ~1.7x on one small pass in 16 (ViT-S on 2 cores; where
# passes are sharded, only one-tile passes are asked).
_PROBE = 16
# A measurement counts for at most this many times the average so far: one preempted pass
# (a tile of the tiny model has taken 50 ms on one thread) must not flip the choice alone.
_OUTLIER = 3.0


class CoreShare:
    """The forward pass's and the decoders' measured costs, and the split they imply.

    Thread-safe: decode threads and the device thread record, the device thread asks.
    """

    def __init__(self, decode_threads: int) -> None:
        self.decode_threads = decode_threads
        self._lock = threading.Lock()
        self._decode = _PerTile()  # one decode thread
        self._forward = _PerTile()  # normalized to every thread
        self._kept = 0  # loaded passes that kept every core since the last that left

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
        Until both costs are known, the decoders' cores, up to half of them (module
        docstring); while the answer is "none", every ``_PROBE``-th pass leaves them anyway,
        to measure again (only passes that leave cores teach the forward cost)."""
        leave = min(self.decode_threads, all_threads - 1)
        if leave <= 0:
            return 0
        with self._lock:
            forward, decode = self._forward.per_tile(), self._decode.per_tile()
            if forward is None or decode is None:
                return min(leave, all_threads // 2)
            if forward * leave / (all_threads - leave) <= _SLACK * decode:
                self._kept = 0
                return leave
            self._kept += 1
            if self._kept >= _PROBE:
                self._kept = 0
                return leave
            return 0


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
            average = self.per_tile()
            if average is not None:
                seconds = min(seconds, _OUTLIER * average * tiles)
            self.seconds = self.seconds * _DECAY + seconds
            self.tiles = self.tiles * _DECAY + tiles

    def per_tile(self) -> float | None:
        return self.seconds / self.tiles if self.tiles else None
