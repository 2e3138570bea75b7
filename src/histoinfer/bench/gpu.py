"""The GPU check: raw vs dynamic throughput of the small and a ViT-L-sized model on CUDA.

One command, under 5 minutes on a machine with a GPU (``benchmarks/gpu_check.py``):

* exports the reference ``small`` (ViT-S/16) and ``large`` (ViT-L/16) h1 checkpoints (cached);
* for each, at ``max_batch_size`` 64 and 256: raw ``forward_batch`` over pre-stacked tiles, and
  dynamic batching (``predict_async`` on asyncio, 4 batches' worth in flight) over the same
  bodies; optionally under ``torch.autocast`` (bf16 or fp16);
* prints a table: tiles/s, dynamic / raw, mean batch size, forward busy share, p95 latency.

Without CUDA it says so and exits 0; ``--cpu-smoke`` then runs the same code on the tiny model
on the CPU, to check that the script itself works.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

__all__ = ["main"]


@contextlib.contextmanager
def _autocast(device: str, dtype: str | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device, dtype=getattr(torch, dtype)):
        yield


def _with_autocast(model: Any, device: str, dtype: str | None) -> None:
    """Make ``model.forward_batch`` run under autocast on whatever thread calls it.

    Autocast is thread-local and dynamic batching runs forward passes on worker threads, so it
    is entered inside each call rather than around the benchmark.
    """
    if dtype is None:
        return
    forward: Callable[..., Any] = model.forward_batch

    def forward_batch(batch: torch.Tensor, mode: Any) -> Any:
        with _autocast(device, dtype):
            return forward(batch, mode)

    model.forward_batch = forward_batch


def _raw(model: Any, tiles: Sequence[torch.Tensor], batch: int) -> tuple[float, float]:
    stacks = [torch.stack(list(tiles[i : i + batch])) for i in range(0, len(tiles), batch)]
    model.forward_batch(stacks[0], "predict")  # warm-up at this shape
    t0 = time.perf_counter()
    latencies = []
    for stack in stacks:
        s0 = time.perf_counter()
        model.forward_batch(stack, "predict")
        latencies.append(time.perf_counter() - s0)
    wall = time.perf_counter() - t0
    return len(tiles) / wall, sorted(latencies)[int(0.95 * (len(latencies) - 1))]


def _dynamic(
    model: Any, bodies: Sequence[str], batch: int, prepare_threads: int | None
) -> dict[str, float]:
    from ..clients.inprocess import InProcessClient
    from .measure import check_responses, drive_async, percentile

    with InProcessClient(
        model, max_batch_size=batch, max_wait_ms=5.0, prepare_threads=prepare_threads
    ) as client:
        anyio.run(drive_async, client.predict_async, bodies[: 2 * batch], 2 * batch)  # warm-up
        before = client.stats()["predict"]
        wall, latencies, responses = anyio.run(drive_async, client.predict_async, bodies, 4 * batch)
        after = client.stats()["predict"]
    check_responses(responses, "dynamic")
    batches = after.batches - before.batches
    return {
        "throughput": len(bodies) / wall,
        "mean_batch": (after.samples - before.samples) / batches if batches else 0.0,
        "busy": (after.forward_busy_s - before.forward_busy_s) / wall,
        "p95_ms": percentile(latencies, 0.95) * 1000,
    }


def run_check(
    sizes: Sequence[str],
    batch_sizes: Sequence[int],
    device: str,
    autocast: str | None,
    batches_per_run: int,
    workdir: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    from ..models import build_server_model
    from ..schema import parse_request
    from .runner import ensure_checkpoint, load_bodies

    n = max(batch_sizes) * batches_per_run
    bodies = load_bodies(n, 0, workdir, log)
    rows = []
    for size in sizes:
        checkpoint = ensure_checkpoint(size, workdir, log)
        log(f"loading h1 {size} on {device} ...")
        model = build_server_model("h1", checkpoint, device)
        _with_autocast(model, device.split(":")[0], autocast)
        tiles = [model.prepare_sample(parse_request(b)) for b in bodies]
        for batch in batch_sizes:
            count = batch * batches_per_run
            raw, raw_p95 = _raw(model, tiles[:count], batch)
            dyn = _dynamic(model, bodies[:count], batch, None)
            row = {
                "model": size,
                "batch": batch,
                "tiles": count,
                "autocast": autocast or "fp32",
                "raw": raw,
                "raw_batch_ms": raw_p95 * 1000,
                "dynamic": dyn["throughput"],
                "ratio": dyn["throughput"] / raw,
                "mean_batch": dyn["mean_batch"],
                "busy": dyn["busy"],
                "p95_ms": dyn["p95_ms"],
            }
            rows.append(row)
            log(
                f"{size} batch {batch}: raw {raw:.0f} tiles/s, dynamic {dyn['throughput']:.0f} "
                f"tiles/s ({row['ratio']:.2f}x)"
            )
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | batch | tiles | precision | raw tiles/s | dynamic tiles/s | dynamic/raw | "
        "mean batch | forward busy | dynamic p95 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tiles']} | {r['autocast']} | {r['raw']:.0f} | "
            f"{r['dynamic']:.0f} | {r['ratio']:.2f} | {r['mean_batch']:.1f} | "
            f"{100 * r['busy']:.0f}% | {r['p95_ms']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from .runner import default_workdir

    parser = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Raw vs dynamic-batching throughput on a GPU (small and ViT-L h1 models).",
    )
    parser.add_argument("--models", default="small,large", help="reference sizes")
    parser.add_argument("--batch-sizes", default="64,256", help="max_batch_size values")
    parser.add_argument(
        "--autocast", choices=["none", "bf16", "fp16", "both"], default="none",
        help="also run under torch.autocast (both = fp32, bf16 and fp16)",
    )  # fmt: skip
    parser.add_argument("--batches", type=int, default=8, help="batches per measurement")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", type=Path, default=default_workdir())
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="without CUDA: run the tiny model on the CPU at batch 8 and 16 (checks the script)",
    )
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    sizes = [s.strip() for s in args.models.split(",") if s.strip()]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        if not args.cpu_smoke:
            print("gpu_check: CUDA is not available on this machine; nothing to measure.")
            print("  (run it where a GPU is; --cpu-smoke checks the script on the CPU)")
            return 0
        sizes, batch_sizes, device = ["tiny"], [8, 16], "cpu"
        args.batches = 2
    if device.startswith("cuda"):
        log(f"device: {torch.cuda.get_device_name(0)}")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    choices: dict[str, list[str | None]] = {
        "none": [None],
        "bf16": [None, "bfloat16"],
        "fp16": [None, "float16"],
        "both": [None, "bfloat16", "float16"],
    }
    precisions = choices[args.autocast]
    if device == "cpu":
        precisions = [p for p in precisions if p != "float16"]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for precision in precisions:
        rows += run_check(sizes, batch_sizes, device, precision, args.batches, args.workdir, log)
    print(table(rows))
    print(f"\n{time.perf_counter() - started:.0f} s on {device}")
    return 0
