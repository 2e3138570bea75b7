#!/usr/bin/env python
"""Where one request's time goes, and which steps hold the GIL (needs py-spy for the GIL part).

python benchmarks/profile_request.py [--quick]
"""

from histoinfer.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(
        main(
            prog="python benchmarks/profile_request.py",
            description=__doc__,
            defaults=["--suites", "profile", "--out", "bench-results/profile"],
        )
    )
