#!/usr/bin/env python
"""A lone request's latency (concurrency 1, max_wait_ms=5) vs raw forward(1).

python benchmarks/lone_latency.py [--small] [--rounds N]
"""

from histoinfer.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(
        main(
            prog="python benchmarks/lone_latency.py",
            description=__doc__,
            defaults=["--suites", "latency", "--out", "bench-results/latency"],
        )
    )
