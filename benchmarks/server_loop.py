#!/usr/bin/env python
"""The server's event loop: its CPU a request with uvicorn's h11 and httptools parsers.

On a fast device the server's one event loop (HTTP parsing, routing, bodies, responses, the
batching's hand-offs) is what bounds a process's requests a second (docs/server.md,
"Deployment notes"). Each round starts one ``histoinfer serve`` (tiny model) per parser, in
alternating order, sends it a warm-up and then two measurements of ``--bodies`` calls from
``HttpClient`` at ``--in-flight``, and reads the CPU clock of the server's main thread from
/proc (Linux only). ``--src A,B`` compares two versions of histoinfer instead (their ``src/``
folders, each server with its default parser): the client is this checkout's.

python benchmarks/server_loop.py [--rounds 6] [--in-flight 64] [--src OLD/src,NEW/src]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

from histoinfer.bench.loopback import ServerProcess
from histoinfer.bench.measure import check_responses, drive_async
from histoinfer.bench.runner import default_workdir, ensure_checkpoint, load_bodies
from histoinfer.clients.http import HttpClient

PARSERS = ("h11", "httptools")


def serve_with(parser: str) -> int:
    """``histoinfer serve`` with its HTTP protocol pinned to ``parser``: uvicorn's h11 one, or
    the httptools one ``serve`` runs (with its request heads bounded: server/guarded_http.py)."""
    import uvicorn.config

    from histoinfer.cli import main
    from histoinfer.server import cli as server_cli

    uvicorn.config.HTTP_PROTOCOLS["auto"] = uvicorn.config.HTTP_PROTOCOLS[parser]
    if parser == "h11":
        server_cli._http_protocol = lambda: "h11"  # type: ignore[attr-defined]
    return main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--bodies", type=int, default=512, help="calls a measurement")
    parser.add_argument("--workdir", type=Path, default=default_workdir())
    parser.add_argument("--src", help="two src/ folders to compare, A,B (instead of parsers)")
    args = parser.parse_args()
    if not Path("/proc/self/stat").is_file():  # ServerProcess.cpu_s() would be None
        sys.exit("this benchmark reads the server's CPU from /proc: Linux only")
    # Each variant: how its server is started (launcher, environment).
    variants: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
        name: ((__file__, "--serve-with", name), {}) for name in PARSERS
    }
    if args.src:
        a, b = (str(Path(p).resolve()) for p in args.src.split(","))
        variants = {
            "A": (("-m", "histoinfer"), {"PYTHONPATH": a}),
            "B": (("-m", "histoinfer"), {"PYTHONPATH": b}),
        }
    checkpoint = ensure_checkpoint("tiny", args.workdir, print)
    bodies = load_bodies(args.bodies, 0, args.workdir, print)
    rows: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    names = list(variants)
    serve = ["--model", "h1", "--checkpoint", str(checkpoint)]

    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            launcher, env = variants[name]
            with ServerProcess(serve, launcher=launcher, env=env) as server:

                async def run(url: str = server.base_url) -> list[str | None]:
                    async with HttpClient(url, "h1") as client:
                        _, _, responses = await drive_async(
                            client.predict_async, bodies, args.in_flight
                        )
                    return responses

                anyio.run(run)  # warm-up
                started = time.perf_counter()
                loop_cpu, server_cpu = server.main_thread_cpu_s(), server.cpu_s()
                for _ in range(2):
                    check_responses(anyio.run(run), "http")
                n, wall = 2 * len(bodies), time.perf_counter() - started
                rows[name].append(
                    (
                        n / wall,
                        1000 * (server.main_thread_cpu_s() - loop_cpu) / n,
                        1000 * (server.cpu_s() - server_cpu) / n,
                    )
                )
            tiles_s, loop_ms, server_ms = rows[name][-1]
            print(
                f"round {r + 1}, {name:>9}: {tiles_s:6.1f} tiles/s, event loop {loop_ms:.3f} ms "
                f"a request, server {server_ms:.2f}",
                flush=True,
            )
    print(f"\nmedians ({args.rounds} rounds, {args.in_flight} in flight):")
    for name, measured in rows.items():
        tiles_s, loop_ms, server_ms = (statistics.median(c) for c in zip(*measured, strict=True))
        print(
            f"  {name:>9}: {tiles_s:6.1f} tiles/s, the server's event loop {loop_ms:.3f} ms of "
            f"CPU a request, the server {server_ms:.2f}"
        )
    if args.src:
        print(f"  A: {args.src.split(',')[0]}\n  B: {args.src.split(',')[1]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-with"]:
        name = sys.argv[2]
        del sys.argv[1:3]
        raise SystemExit(serve_with(name))
    main()
