#!/usr/bin/env python
"""Dynamic batching vs the explicit batch loop vs batch size 1, on asyncio and trio (issue 3).

    python benchmarks/throughput.py            # tiny model, 1/8/64/512 in flight, 5 rounds
    python benchmarks/throughput.py --quick    # fewer levels, tiles and rounds

Writes report.json, report.md and report.png under --out (default bench-results/throughput).
The same options as ``histoinfer bench``; options given here override the defaults below.
"""

from histoinfer.bench.cli import main

DEFAULTS = [
    "--suites=throughput",
    "--paths=raw,explicit,dynamic-asyncio,dynamic-trio,bs1-asyncio,bs1-trio",
    "--modes=predict",
    "--out=bench-results/throughput",
]

if __name__ == "__main__":
    raise SystemExit(
        main(prog="python benchmarks/throughput.py", defaults=DEFAULTS, description=__doc__)
    )
