"""The names of what the bench measures, importable without torch.

The process that runs ``histoinfer bench`` only orchestrates: it starts a child process per
path, collects the samples and writes the report. It needs the names (for defaults, ``--help``
and the report), not the paths and models themselves, which import torch: ~5 s of a 2-core
machine's time before anything is measured. Tests keep these equal to ``paths.PATHS`` and
``models.h1.REFERENCE_DTYPES``.
"""

from __future__ import annotations

__all__ = ["LONE_VARIANTS", "PATH_NAMES", "REFERENCE_DTYPES"]

#: every throughput path, in the order the report lists them (``paths.PATHS``)
PATH_NAMES = (
    "raw",
    "explicit",
    "explicit-parallel",
    "dynamic-asyncio",
    "dynamic-asyncio-twin",
    "dynamic-trio",
    "bs1-asyncio",
    "bs1-trio",
    "sync-threads",
    "http",
    "async-batcher",
    "asyncio-queue",
)

#: what a lone request is compared with, in each round (``latency.LoneLatency.measure``)
LONE_VARIANTS = (
    "raw-forward-1",
    "raw-forward-1-hot",
    "pipeline-1",
    "dynamic-asyncio",
    "dynamic-trio",
)

#: the precisions ``histoinfer export --dtype`` builds reference checkpoints in (models.h1)
REFERENCE_DTYPES = ("float32", "bfloat16", "float16")
