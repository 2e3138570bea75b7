#!/usr/bin/env python
"""How HttpClient splits its connections: client shards of N connections, one TLS context or
one per httpx client, side by side against one ``histoinfer serve`` (docs/server.md).

httpcore walks every connection of a pool, some walks quadratic in them, each time a request
starts or ends; HttpClient therefore splits a loop's connections over several httpx clients.
Each layout below is measured in turn, in interleaved rounds, with a new HttpClient a round (as
the bench's HTTP path makes one a measurement): tiles/s, and the client's and the server's CPU
a tile. ``--calls sync`` sends blocking calls from ``--in-flight`` threads instead of async
calls on one loop.

python benchmarks/http_client_pools.py [--shards 16,4] [--rounds 6] [--in-flight 512]
                                       [--calls async|sync]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

import histoinfer.clients.http as http_module
from histoinfer.bench.loopback import ServerProcess
from histoinfer.bench.measure import check_responses, drive_async, drive_threads
from histoinfer.bench.runner import default_workdir, ensure_checkpoint, load_bodies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="16,4", help="connections per httpx client")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--in-flight", type=int, default=512, help="calls in flight")
    parser.add_argument("--bodies", type=int, default=512, help="tiles a measurement")
    parser.add_argument("--calls", choices=["async", "sync"], default="async")
    parser.add_argument("--workdir", type=Path, default=default_workdir())
    args = parser.parse_args()
    if not Path("/proc/self/stat").is_file():  # ServerProcess.cpu_s() would be None
        sys.exit("this benchmark reads the server's CPU from /proc: Linux only")
    checkpoint = ensure_checkpoint("tiny", args.workdir, print)
    bodies = load_bodies(args.bodies, 0, args.workdir, print)
    # Each shard size with a TLS context per httpx client (httpx's default) and with one shared.
    layouts = [(int(n), shared) for n in args.shards.split(",") for shared in (False, True)]
    rows: dict[tuple[int, bool], list[tuple[float, float, float]]] = {k: [] for k in layouts}

    with ServerProcess(["--model", "h1", "--checkpoint", str(checkpoint)]) as server:

        def measure(shard: int, shared_tls: bool) -> tuple[float, float, float]:
            http_module._SHARD_CONNECTIONS = shard  # read when an HttpClient is made

            client = http_module.HttpClient(server.base_url, "h1")
            client._options.share_tls = client._options.share_tls and shared_tls

            async def run() -> tuple[float, list[float], list[str | None]]:
                async with client:
                    return await drive_async(client.predict_async, bodies, args.in_flight)

            cpu, server_cpu = time.process_time(), server.cpu_s()
            if args.calls == "async":
                wall, _, responses = anyio.run(run)
            else:
                with client:
                    wall, _, responses = drive_threads(client.predict, bodies, args.in_flight)
            check_responses(responses, "http")
            n = len(bodies)
            return (
                n / wall,
                1000 * (time.process_time() - cpu) / n,
                1000 * (server.cpu_s() - server_cpu) / n,
            )

        for layout in layouts:  # warm-up: the server's first passes, the client's imports
            measure(*layout)
        for r in range(args.rounds):
            for layout in layouts if r % 2 == 0 else layouts[::-1]:
                rows[layout].append(measure(*layout))
                tiles_s, client, served = rows[layout][-1]
                print(
                    f"round {r + 1}: shards of {layout[0]:>3}, "
                    f"{'one TLS context ' if layout[1] else 'TLS per client'}: "
                    f"{tiles_s:6.1f} tiles/s, client {client:.2f}, server {served:.2f} ms a tile",
                    flush=True,
                )

    print(
        f"\nmedians ({args.rounds} rounds, {args.calls} calls, {args.in_flight} in flight, "
        f"{len(bodies)} tiles):"
    )
    base = statistics.median(r[0] for r in rows[layouts[0]])
    for layout, measured in rows.items():
        columns = zip(*measured, strict=True)
        tiles_s, client, served = (statistics.median(column) for column in columns)
        print(
            f"  shards of {layout[0]:>3}, {'one TLS context' if layout[1] else 'TLS per client '}"
            f": {tiles_s:6.1f} tiles/s ({tiles_s / base:.3f}x the first), "
            f"client {client:.2f}, server {served:.2f} ms a tile"
        )


if __name__ == "__main__":
    main()
