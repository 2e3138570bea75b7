#!/usr/bin/env python
"""``/batch`` calls in progress at once: tiles a second and the server's memory, by how many.

What ``--max-batch-calls`` (docs/server.md, "Load shedding") is chosen from. Each round, for
each level in turn (the order alternating between rounds), a fresh ``histoinfer serve`` (tiny
model, no effective limit; fresh, as an allocator keeps what it once took) and that many
threads each send ``--batches`` ``/batch`` calls of
``--tiles`` tiles back to back through ``HttpClient.predict_batch``. Reports tiles a second
and the most resident memory the server reached during the level (sampled from /proc every
10 ms, Linux only), medians over rounds.

python benchmarks/batch_calls.py [--rounds 4] [--levels 1,2,4,8] [--tiles 512] [--batches 2]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from histoinfer.bench.loopback import ServerProcess
from histoinfer.bench.measure import check_responses
from histoinfer.bench.runner import default_workdir, ensure_checkpoint, load_bodies
from histoinfer.clients.http import HttpClient


def resident_mb(pid: int) -> float:
    """The process's resident memory in MB (VmRSS), 0 if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakMemory:
    """The most resident memory ``pid`` reaches while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, resident_mb(self.pid))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rounds", type=int, default=4, help="interleaved rounds (default: %(default)s)")
    add("--levels", default="1,2,4,8", help="calls at once, each (default: %(default)s)")
    add("--tiles", type=int, default=512, help="tiles a /batch call (default: %(default)s)")
    add("--batches", type=int, default=2, help="calls each thread sends (default: %(default)s)")
    add("--workdir", type=Path, default=default_workdir(), help="checkpoint and body cache")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",")]
    checkpoint = ensure_checkpoint("tiny", args.workdir, print)
    bodies = load_bodies(args.tiles, 0, args.workdir, print)
    serve = ["--model", "h1", "--checkpoint", str(checkpoint)]
    serve += ["--max-batch-calls", str(max(levels)), "--max-body-mb", "1024"]
    rows: dict[int, list[tuple[float, float]]] = {level: [] for level in levels}

    def measure(level: int) -> tuple[float, float]:
        with ServerProcess(serve) as server, HttpClient(server.base_url, "h1", timeout=600) as c:

            def send(_: int) -> None:
                for _ in range(args.batches):
                    check_responses(c.predict_batch(bodies), "batch")

            check_responses(c.predict_batch(bodies[:64]), "batch")  # warm-up
            with PeakMemory(server.proc.pid) as memory, ThreadPoolExecutor(level) as pool:
                started = time.perf_counter()
                list(pool.map(send, range(level)))
                wall = time.perf_counter() - started
        return level * args.batches * args.tiles / wall, memory.peak

    for r in range(args.rounds):
        for level in levels if r % 2 == 0 else levels[::-1]:
            rows[level].append(measure(level))
            tiles_s, peak = rows[level][-1]
            print(
                f"round {r + 1}, {level} at once: {tiles_s:6.1f} tiles/s, server peak "
                f"{peak:.0f} MB",
                flush=True,
            )
    print(f"\nmedians ({args.rounds} rounds, {args.tiles} tiles a call):")
    for level, measured in rows.items():
        tiles_s, peak = (statistics.median(c) for c in zip(*measured, strict=True))
        print(f"  {level} at once: {tiles_s:6.1f} tiles/s, server peak {peak:.0f} MB")


if __name__ == "__main__":
    main()
