"""How many CPUs this process may run on.

``os.cpu_count()`` counts the machine's, not the process's: under ``taskset``, a SLURM job's
cpuset or a container given some cores of a large host, it says 64 where the process has 4.
torch's OpenMP threads (``torch.get_num_threads()``) follow the process's affinity; sizing
decode threads from the machine's count beside them oversubscribed the cores granted (on a
SLURM job of 4 cores on a 64-core node: 64 decode threads a loop beside 4 for the passes).
A CPU quota without a cpuset (a Kubernetes ``limits.cpu`` alone) is not seen, as torch does
not see it either: set ``OMP_NUM_THREADS`` and ``prepare_threads`` there (docs/batching.md,
"Tuning").
"""

from __future__ import annotations

import os

__all__ = ["usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux (macOS, Windows)
        return os.cpu_count() or 1
