"""``histoinfer bench``: throughput, latency and overhead benchmarks (see docs/benchmarks.md).

Paths, drivers and reports live in submodules; ``histoinfer.bench.cli`` plugs into the
``histoinfer`` command, and ``benchmarks/*.py`` are thin scripts over the same code.
"""

from .bodies import make_bodies, tissue_tile
from .measure import Sample
from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "Sample", "make_bodies", "run_bench", "tissue_tile"]
