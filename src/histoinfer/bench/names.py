"""The names of what the bench measures, importable without torch.

The process that runs ``histoinfer bench`` only orchestrates: it starts a child process per
path, collects the samples and writes the report. It needs the names (for defaults, ``--help``
and the report), not the paths and models themselves, which import torch: ~5 s of a 2-core
machine's time before anything is measured. Tests keep these equal to ``paths.PATHS`` and
``models.h1.REFERENCE_DTYPES``.
"""

from __future__ import annotations

__all__ = ["LONE_VARIANTS", "PATH_DESCRIPTIONS", "PATH_NAMES", "REFERENCE_DTYPES"]

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

#: what each path runs, in a line (the report's legend; docs/benchmarks.md has the details);
#: ``{mode}`` is the call's mode (``predict``, ``embed``, ``predict_with_embedding``)
PATH_DESCRIPTIONS = {
    "raw": "the forward pass alone, over pre-decoded, pre-stacked tiles: the limit",
    "explicit": "InProcessClient(dynamic_batching=False).{mode}_batch over chunks of the bodies",
    "explicit-parallel": "the same, each chunk's bodies decoded on batch_decode_threads threads",
    "dynamic-asyncio": "concurrent {mode}_async calls, dynamically batched, on asyncio",
    "dynamic-asyncio-twin": "dynamic-asyncio again in another process: the noise floor",
    "dynamic-trio": "concurrent {mode}_async calls, dynamically batched, on trio",
    "bs1-asyncio": "concurrent {mode}_async calls at batch size 1 (dynamic_batching=False)",
    "bs1-trio": "the same on trio",
    "sync-threads": "blocking {mode} from as many threads as in flight",
    "http": "histoinfer serve on 127.0.0.1 and HttpClient.{mode}_async",
    "async-batcher": "the async-batcher package around the same pipeline (the peer)",
    "asyncio-queue": "a plain asyncio.Queue batcher as a user would write it, same pipeline",
}

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
