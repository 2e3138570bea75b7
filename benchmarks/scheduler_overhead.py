#!/usr/bin/env python
"""``BatchScheduler`` alone with a no-op batch function, vs async-batcher (requests/s).

python benchmarks/scheduler_overhead.py [--quick] [--rounds N]
"""

from histoinfer.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(
        main(
            prog="python benchmarks/scheduler_overhead.py",
            description=__doc__,
            defaults=["--suites", "overhead", "--out", "bench-results/overhead"],
        )
    )
