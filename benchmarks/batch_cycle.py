#!/usr/bin/env python
"""Where a batch's cycle goes at moderate concurrency: the pass, and everything outside it.

With N callers in flight and batches of N, no decode can overlap the pass that holds every
caller: a cycle is the callers' turn (response, next request, decode on the decode threads)
then the pass. This prints, per N, the throughput, the batch sizes the scheduler formed, the
pass's time a batch (the clients' own statistics, timed on the device's thread) and the time
outside it a cycle, against the explicit loop in chunks of N. Session 15 saw dynamic batching
at 8 in flight spend ~10 ms a cycle outside the pass where decoding 8 bodies on 2 threads
takes ~4.4; session 16 found why (the OpenMP team's worker spinning after each small pass on
the core the decoders needed) and shards small batches since (docs/benchmarks.md, "A few
callers at a time").

python benchmarks/batch_cycle.py [--workdir DIR] [--reps N]
"""

from __future__ import annotations

import time

import anyio

from histoinfer import InProcessClient
from histoinfer.bench.measure import drive_async
from histoinfer.bench.runner import tiny_script

LEVELS = (4, 8, 16)
TILES = 384


def main() -> None:
    args, model, bodies = tiny_script(__doc__, TILES)
    for rep in range(args.reps):
        for level in LEVELS:
            dynamic = InProcessClient(model, max_wait_ms=5.0)
            explicit = InProcessClient(model, dynamic_batching=False)
            try:
                anyio.run(drive_async, dynamic.predict_async, bodies[:64], level)  # warm
                before = dynamic.stats()["predict"]
                wall, _, _ = anyio.run(drive_async, dynamic.predict_async, bodies, level)
                after = dynamic.stats()["predict"]
                started = time.perf_counter()
                for start in range(0, TILES, level):
                    explicit.predict_batch(bodies[start : start + level])
                loop_wall = time.perf_counter() - started
            finally:
                dynamic.close()
                explicit.close()
            batches = after.batches - before.batches
            busy = after.forward_busy_s - before.forward_busy_s
            sizes = {
                size: count - before.batch_size_histogram.get(size, 0)
                for size, count in after.batch_size_histogram.items()
                if count > before.batch_size_histogram.get(size, 0)
            }
            print(
                f"rep {rep + 1} N={level:<3} dynamic {TILES / wall:6.1f} tiles/s "
                f"(explicit in chunks of N {TILES / loop_wall:6.1f}), batches {batches} "
                f"{dict(sorted(sizes.items()))}, pass {1000 * busy / batches:5.1f} ms a batch, "
                f"outside it {1000 * (wall - busy) / batches:5.1f} ms a cycle"
            )


if __name__ == "__main__":
    main()
