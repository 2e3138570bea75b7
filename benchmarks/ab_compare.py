#!/usr/bin/env python
"""Two versions of histoinfer side by side, in the same minutes: is a change faster?

    git worktree add /tmp/before <commit>
    python benchmarks/ab_compare.py --a /tmp/before/src --b src --rounds 8

Runs four worker processes, two per version, each holding a dynamic and an explicit
``InProcessClient`` of the tiny reference model, and asks them in turn, round after round, to
measure: ``dynamic`` (512 bodies at once, ``predict_async``, asyncio), ``explicit``
(``predict_batch`` over chunks of 64) and ``lone`` (p50 ms of 100 single requests, 2 ms apart;
``--bodies`` and ``--lone-calls`` change the counts); on request (``--measure``), ``dynamic-8``
(the bodies with 8 in flight) and ``bs1`` (all at once, ``dynamic_batching=False``).
Prints each version's median and B / A.

Why this shape (docs/benchmarks-history.md, "Session 6"): the machine's load drifts by 2x within
minutes, so versions are interleaved, never run one after the other. And identical processes
started one after another measured faster the later they started (586, 599, 609 and 619
tiles/s for four copies of the same code), so the workers start in the order A B B A, which
cancels a trend of that kind, and are asked in a rotating order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MEASURES = ("dynamic", "explicit", "lone")
EXTRA_MEASURES = ("dynamic-8", "bs1")


def worker(checkpoint: str, bodies_file: str, lone_calls: str) -> None:
    """Load one version's clients, then answer one measurement per line read from stdin."""
    import gc
    import logging

    import anyio

    from histoinfer import InProcessClient, build_server_model

    logging.getLogger("histoinfer.untrained").disabled = True  # known: reference checkpoints

    bodies: list[str] = json.loads(Path(bodies_file).read_text(encoding="utf-8"))
    model = build_server_model("h1", checkpoint)
    dynamic = InProcessClient(model)
    explicit = InProcessClient(model, dynamic_batching=False)

    bs1 = InProcessClient(model, dynamic_batching=False)

    async def all_at_once(client: InProcessClient = dynamic) -> None:
        async with anyio.create_task_group() as group:
            for body in bodies:
                group.start_soon(client.predict_async, body)

    async def in_flight(count: int) -> None:
        queue = iter(bodies)

        async def caller() -> None:
            for body in queue:
                await dynamic.predict_async(body)

        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(caller)

    def chunks() -> None:
        for start in range(0, len(bodies), 64):
            explicit.predict_batch(bodies[start : start + 64])

    async def lone() -> float:
        latencies = []
        for body in bodies[: int(lone_calls)]:
            started = time.perf_counter()
            await dynamic.predict_async(body)
            latencies.append(time.perf_counter() - started)
            await anyio.sleep(0.002)
        return statistics.median(latencies) * 1e3

    anyio.run(all_at_once)
    anyio.run(all_at_once, bs1)
    chunks()
    anyio.run(lone)
    gc.collect()
    gc.freeze()  # as the bench does: no full collection of the start-up heap mid-measurement
    print("READY", flush=True)
    for line in sys.stdin:
        what = line.strip()
        started, cpu = time.perf_counter(), time.process_time()
        if what == "dynamic":
            anyio.run(all_at_once)
            value = len(bodies) / (time.perf_counter() - started)
        elif what == "dynamic-8":
            anyio.run(in_flight, 8)
            value = len(bodies) / (time.perf_counter() - started)
        elif what == "bs1":
            anyio.run(all_at_once, bs1)
            value = len(bodies) / (time.perf_counter() - started)
        elif what == "explicit":
            chunks()
            value = len(bodies) / (time.perf_counter() - started)
        elif what == "lone":
            value = anyio.run(lone)
        else:
            break
        calls = min(int(lone_calls), len(bodies)) if what == "lone" else len(bodies)
        cpu_ms = (time.process_time() - cpu) / calls * 1e3
        print(json.dumps({"value": value, "cpu_ms": cpu_ms}), flush=True)
    dynamic.close()
    explicit.close()
    bs1.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="version A's src/ folder (the baseline)")
    parser.add_argument("--b", required=True, help="version B's src/ folder")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--measure", default=",".join(MEASURES), help=",".join(MEASURES + EXTRA_MEASURES)
    )
    parser.add_argument("--bodies", type=int, default=512, help="bodies a measurement sends")
    parser.add_argument("--lone-calls", type=int, default=100, help="calls per lone")
    parser.add_argument("--workdir", type=Path, default=None, help="bench cache dir")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    measures = args.measure.split(",")
    if unknown := set(measures) - set(MEASURES + EXTRA_MEASURES):
        parser.error(f"unknown measure(s): {', '.join(sorted(unknown))}")

    from histoinfer.bench.runner import default_workdir, ensure_checkpoint, load_bodies

    workdir = args.workdir or default_workdir()
    checkpoint = ensure_checkpoint("tiny", workdir, print)
    bodies_file = workdir / f"ab-bodies-{args.bodies}.json"
    bodies_file.write_text(
        json.dumps(load_bodies(args.bodies, 0, workdir, print)), encoding="utf-8"
    )

    def start(src: str) -> subprocess.Popen[str]:
        command = [sys.executable, __file__, "--a", "-", "--b", "-", "--worker"]
        return subprocess.Popen(
            [*command, str(checkpoint), str(bodies_file), str(args.lone_calls)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(src).resolve())},
        )

    workers: list[tuple[str, subprocess.Popen[str]]] = []
    for name, src in (("A", args.a), ("B", args.b), ("B", args.b), ("A", args.a)):
        process = start(src)  # one at a time: each loads and warms up alone
        assert process.stdout is not None
        if process.stdout.readline().strip() != "READY":
            raise SystemExit(f"a worker of version {name} ({src}) failed to start")
        workers.append((name, process))
    values: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for what in measures:
                for name, process in workers[r % 4 :] + workers[: r % 4]:
                    assert process.stdin is not None and process.stdout is not None
                    process.stdin.write(what + "\n")
                    process.stdin.flush()
                    answer = json.loads(process.stdout.readline())
                    values.setdefault((what, name), []).append(answer["value"])
                    cpu.setdefault((what, name), []).append(answer["cpu_ms"])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for _, process in workers:
            assert process.stdin is not None
            process.stdin.write("quit\n")
            process.stdin.close()
            process.wait(timeout=60)
    unit = {"lone": "ms p50"}
    print(f"A = {args.a}\nB = {args.b}\n")
    print("| measure | A | B | B / A | CPU ms a tile, A → B |\n|---|---|---|---|---|")
    for what in measures:
        a, b = (statistics.median(values[(what, name)]) for name in "AB")
        cpu_a, cpu_b = (statistics.median(cpu[(what, name)]) for name in "AB")
        print(
            f"| {what} ({unit.get(what, 'tiles/s')}) | {a:.2f} | {b:.2f} | {b / a:.3f} | "
            f"{cpu_a:.2f} → {cpu_b:.2f} |"
        )


if __name__ == "__main__":
    main()
