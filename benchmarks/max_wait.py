#!/usr/bin/env python
"""What max_wait_ms does for a fixed set of callers: N tasks or N threads, each sending its next
request when answered (a notebook's handful of concurrent calls, a thread pool mapping
``predict``), against the explicit loop in chunks of N.

With N callers, a batch holds all N only if the window (``max_wait_ms``, counted from the first
decoded request) covers the time until the last one's body is decoded: about N decodes spread
over the decode threads, plus, for threads, each caller's wake-up and hand-off to the client's
loop. Shorter, and the callers split into groups whose passes are smaller and more frequent; on
a CPU, where the groups' decoding and passes share the same cores, that costs throughput. Each
window is measured with a new client, interleaved within a round (docs/batching.md, "Tuning").
Async callers run on asyncio.

python benchmarks/max_wait.py [--waits 2,5,10,20] [--in-flight 4,8,16] [--calls async,threads]
                              [--rounds 3] [--bodies 384]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from histoinfer import InProcessClient
from histoinfer.bench.measure import check_responses, drive_async, drive_threads
from histoinfer.bench.runner import default_workdir, ensure_checkpoint, load_bodies
from histoinfer.models.base import ServerModel
from histoinfer.models.registry import build_server_model

#: tiles/s, p50 ms, p95 ms, mean batch
Reading = tuple[float, float, float, float]
Run = Callable[[Sequence[str]], tuple[float, list[float], list[str | None]]]
EXPLICIT = "explicit"  # the reference row: predict_batch in chunks of N, no window


def measure(
    model: ServerModel, bodies: Sequence[str], calls: str, in_flight: int, wait: str
) -> Reading:
    if wait == EXPLICIT:
        client = InProcessClient(model, dynamic_batching=False)
    else:
        client = InProcessClient(model, max_wait_ms=float(wait))
    with client:
        run = _runner(client, calls, in_flight, wait)
        run(bodies[: min(len(bodies), 4 * in_flight)])  # warm-up
        before = client.stats()["predict"]
        wall, latencies, responses = run(bodies)
        after = client.stats()["predict"]
    check_responses(responses, f"{calls} max_wait_ms={wait}")
    batches = max(1, after.batches - before.batches)
    p50, p95 = (1000 * q for q in _quantiles(latencies))
    return len(bodies) / wall, p50, p95, (after.samples - before.samples) / batches


def _runner(client: InProcessClient, calls: str, in_flight: int, wait: str) -> Run:
    if wait != EXPLICIT and calls == "async":
        return lambda bodies: anyio.run(drive_async, client.predict_async, bodies, in_flight)
    if wait != EXPLICIT:
        return lambda bodies: drive_threads(client.predict, bodies, in_flight)

    def explicit_loop(bodies: Sequence[str]) -> tuple[float, list[float], list[str | None]]:
        responses: list[str | None] = []
        latencies: list[float] = []
        started = time.perf_counter()
        for start in range(0, len(bodies), in_flight):
            t0 = time.perf_counter()
            chunk = list(bodies[start : start + in_flight])
            responses.extend(client.predict_batch(chunk))
            latencies.extend([time.perf_counter() - t0] * len(chunk))
        return time.perf_counter() - started, latencies, responses

    return explicit_loop


def _quantiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=20)
    return statistics.median(values), cuts[18]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--waits", default="2,5,10,20", help="max_wait_ms values to compare (default: %(default)s)")
    add("--in-flight", default="4,8,16", help="callers, comma-separated (default: %(default)s)")
    add("--calls", default="async,threads", help="async, threads or both (default: %(default)s)")
    add("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    add("--bodies", type=int, default=384, help="tiles a measurement (default: %(default)s)")
    add("--workdir", type=Path, default=default_workdir(), help="checkpoint and body cache")
    args = parser.parse_args()
    waits = [w.strip() for w in args.waits.split(",")] + [EXPLICIT]
    for wait in waits[:-1]:
        try:
            if float(wait) < 0:
                parser.error(f"--waits: {wait} is negative")
        except ValueError:
            parser.error(f"--waits: {wait!r} is not a number of milliseconds")
    kinds = [c.strip() for c in args.calls.split(",")]
    if not set(kinds) <= {"async", "threads"}:
        parser.error(f"--calls: {args.calls!r}; use async, threads or both")
    levels = [int(n) for n in args.in_flight.split(",")]
    if min(levels) < 1 or args.rounds < 1 or args.bodies < 1:
        parser.error("--in-flight, --rounds and --bodies must be at least 1")
    model = build_server_model("h1", ensure_checkpoint("tiny", args.workdir, print))
    bodies = load_bodies(args.bodies, 0, args.workdir, print)

    rows: dict[tuple[str, int, str], list[Reading]] = {}
    for r in range(args.rounds):
        for calls in kinds:
            for n in levels:
                # Alternate the order each round: a drift in the host's speed then does not
                # favour one window.
                for wait in waits if r % 2 == 0 else waits[::-1]:
                    reading = measure(model, bodies, calls, n, wait)
                    rows.setdefault((calls, n, wait), []).append(reading)
                    tiles_s, p50, p95, batch = reading
                    print(
                        f"round {r + 1}: {calls:7} N={n:<3} {_label(wait):>21}: "
                        f"{tiles_s:6.1f} tiles/s, p50 {p50:6.1f} ms, p95 {p95:6.1f} ms, "
                        f"mean batch {batch:4.1f}",
                        flush=True,
                    )

    print(f"\nmedians ({args.rounds} rounds, {len(bodies)} tiles a measurement, tiny model):\n")
    print("| callers | N | max_wait_ms | tiles/s | vs explicit | p50 ms | p95 ms | mean batch |")
    print("|---|---|---|---|---|---|---|---|")
    for calls in kinds:
        for n in levels:
            reference = statistics.median(x[0] for x in rows[(calls, n, EXPLICIT)])
            for wait in waits:
                columns = zip(*rows[(calls, n, wait)], strict=True)
                tiles_s, p50, p95, batch = (statistics.median(column) for column in columns)
                print(
                    f"| {calls} | {n} | {_label(wait)} | {tiles_s:.1f} | "
                    f"{tiles_s / reference:.2f} | {p50:.1f} | {p95:.1f} | {batch:.1f} |"
                )


def _label(wait: str) -> str:
    return "explicit, chunks of N" if wait == EXPLICIT else wait


if __name__ == "__main__":
    main()
