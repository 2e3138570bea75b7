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
are on their way (the pipeline is loaded) and ``F * k / (t - k) <= 2 D``: the tiny model on 2
cores (F ~1 ms, D ~1.4 ms) leaves one; ViT-S (F ~45 ms) never does; a 16-core box leaves one
core while ``F <= 30 D``. A lone request always gets every core.

Both costs are measured as the client runs (moving averages of wall time; nothing is left before
both are known), so the choice follows the model and the machine. Wall times under load include
the contention itself, which favours what is already being done: a loaded tiny model measured F
~2.5 and D ~2 ms while not leaving, still under the bound; once leaving, F ~1.3.
"""

from __future__ import annotations

import threading

__all__ = ["CoreShare"]

# Weight of the newest measurement in the moving averages.
_ALPHA = 0.2
# How much more the forward pass may lose than a decode gains: the estimate of what not leaving
# costs ("about D") is low, since spinning workers slow the pass's own thread too. Measured on
# 2 cores: the tiny model gains from leaving a core (F ~1 vs D ~1.4 ms alone, ~2.5 vs ~2 under
# load while not leaving); a 45 ms ViT-S forward per tile never qualifies.
_SLACK = 2.0


class CoreShare:
    """The forward pass's and the decoders' measured costs, and the split they imply.

    Thread-safe: decode threads and the device thread record, the device thread asks.
    """

    def __init__(self, decode_threads: int) -> None:
        self.decode_threads = decode_threads
        self._lock = threading.Lock()
        self._decode_s: float | None = None  # seconds per tile, one decode thread
        self._forward_s: float | None = None  # seconds per tile, at every thread

    def record_decode(self, tiles: int, seconds: float) -> None:
        if tiles > 0:
            with self._lock:
                self._decode_s = _average(self._decode_s, seconds / tiles)

    def record_forward(self, tiles: int, seconds: float, threads: int, all_threads: int) -> None:
        """A forward pass of ``tiles`` took ``seconds`` on ``threads`` of ``all_threads``."""
        if tiles > 0 and all_threads > 0:
            # Normalized to every thread, assuming the pass scales with its threads (it nearly
            # does for batches: 98 vs 49 ms for 51 tiles of the tiny model on 1 and 2 threads).
            per_tile = seconds / tiles * threads / all_threads
            with self._lock:
                self._forward_s = _average(self._forward_s, per_tile)

    def cores_to_leave(self, loaded: bool, all_threads: int) -> int:
        """Threads the next forward pass should leave free; ``loaded``: requests are on their
        way (queued for the next batch, or still being decoded)."""
        leave = min(self.decode_threads, all_threads - 1)
        if not loaded or leave <= 0:
            return 0
        with self._lock:
            forward, decode = self._forward_s, self._decode_s
        if forward is None or decode is None:
            return 0
        return leave if forward * leave / (all_threads - leave) <= _SLACK * decode else 0


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _ALPHA * (new - old)
