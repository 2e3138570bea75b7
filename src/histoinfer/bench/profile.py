"""Where one request's time goes, and which steps hold the GIL.

Three measurements, on the tiny model and the benchmark's own bodies:

1. **Step costs**: each step of a request, alone on one thread (µs per tile): JSON parse and
   validation, base64, PNG decode, resize (only for tiles not already 224 px), tensor build,
   the scheduler's own cost per request, forward, split, postprocess + JSON out (and the
   stack a GPU pass still makes).
2. **GIL scaling**: each CPU step run on 1 thread, then on 2 threads at once. A step that
   releases the GIL runs ~2x as fast in aggregate on 2 cores; one that holds it runs ~1x.
3. **Sampling profile** (py-spy, when installed): a child process runs dynamic batching on
   asyncio with 512 requests in flight; py-spy samples it twice — once only the thread holding
   the GIL (``--gil``: which step holds it, and how much of the wall time the GIL is held at all),
   once every running thread (which step burns CPU). Samples are attributed to steps by the
   deepest recognizable frame.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image

__all__ = ["classify_stack", "run_profile"]

Log = Callable[[str], None]


# -- 1: step costs ------------------------------------------------------------------------------


def _per_call(fn: Callable[[int], object], calls: int, repeats: int = 3) -> tuple[float, float]:
    """Median over ``repeats`` of the mean (wall, process CPU) seconds per call of ``fn(i)``.

    Process CPU counts every thread of the process, torch's own workers included: a step that
    uses 2 cores for 1 ms costs 2 ms of it.
    """
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(calls):
            fn(i)
        walls.append((time.perf_counter() - w0) / calls)
        cpus.append((time.process_time() - c0) / calls)
    return statistics.median(walls), statistics.median(cpus)


#: fast PNG decoder (models/png.py) -> its step
_FAST_PNG_STEPS = {
    "libspng (imagecodecs)": "PNG decode (libspng via imagecodecs, `fast`)",
    "Wuffs (pywuffs)": "PNG decode (Wuffs via pywuffs, `wuffs`)",
    "libdeflate + libspng (imagecodecs)": "PNG decode (libdeflate + libspng, `fast`)",
    "libdeflate + Wuffs": "PNG decode (libdeflate + Wuffs, `fast` + `wuffs`)",
}

#: step name -> (function name py-spy sees, tiles per call)
STEP_NAMES: dict[str, tuple[str, int]] = {
    "JSON parse + validate (pydantic)": ("step_json_parse", 1),
    "base64 decode (binascii)": ("step_base64", 1),
    "base64 decode (pybase64, `fast`)": ("step_base64_fast", 1),
    "PNG open (header, chunks)": ("step_png_open", 1),
    "PNG decode (Pillow: open + load)": ("step_png_decode", 1),
    "PNG decode (libspng via imagecodecs, `fast`)": ("step_png_spng", 1),
    "PNG decode (Wuffs via pywuffs, `wuffs`)": ("step_png_wuffs", 1),
    "PNG decode (libdeflate + libspng, `fast`)": ("step_png_deflate_spng", 1),
    "PNG decode (libdeflate + Wuffs, `fast` + `wuffs`)": ("step_png_deflate_wuffs", 1),
    "resize 256->224 (not on the 224 path)": ("step_resize", 1),
    "tensor build (tobytes + frombuffer)": ("step_tensor", 1),
    "prepare_sample total (base64..tensor)": ("step_prepare", 1),
    "stack (batch of 64; GPUs only since forward_tiles)": ("step_stack", 64),
    "forward (64 tiles, incl. normalize)": ("step_forward64", 64),
    "forward (batch of 1)": ("step_forward1", 1),
    "split (.tolist, batch of 64)": ("step_split", 64),
    "postprocess + JSON out": ("step_postprocess", 1),
}


def step_functions(model: Any, bodies: list[str]) -> dict[str, Callable[[int], object]]:
    """Each step of a request as ``fn(i)`` over ready inputs, keyed like :data:`STEP_NAMES`."""
    from ..models import imaging, png
    from ..models.base import stack_tiles
    from ..schema import parse_request

    n = len(bodies)
    requests = [parse_request(b) for b in bodies]
    raws = [binascii.a2b_base64(r.image_data, strict_mode=True) for r in requests]
    images = []
    for raw in raws:
        image = Image.open(io.BytesIO(raw))
        image.load()
        images.append(image)
    generator = torch.Generator().manual_seed(0)
    big = Image.fromarray(
        torch.randint(0, 256, (256, 256, 3), dtype=torch.uint8, generator=generator).numpy()
    )
    tiles = [model.prepare_sample(r) for r in requests]
    batch64 = [
        stack_tiles([tiles[(k + j) % n] for j in range(64)], keep_layout=True) for k in range(4)
    ]
    outputs = model.forward_batch(batch64[0], "predict")
    samples = outputs.split()

    def png_open(i: int) -> None:
        Image.open(io.BytesIO(raws[i % n])).close()

    def png_decode(i: int) -> None:
        with Image.open(io.BytesIO(raws[i % n])) as image:
            image.load()

    def tensor(i: int) -> None:
        pixels = torch.frombuffer(bytearray(images[i % n].tobytes()), dtype=torch.uint8)
        pixels.view(224, 224, 3).permute(2, 0, 1)

    steps: dict[str, Callable[[int], object]] = {
        "JSON parse + validate (pydantic)": lambda i: parse_request(bodies[i % n]),
        "base64 decode (binascii)": lambda i: binascii.a2b_base64(
            requests[i % n].image_data, strict_mode=True
        ),
        "base64 decode (pybase64, `fast`)": lambda i: imaging._b64decode(
            requests[i % n].image_data
        ),
        "PNG open (header, chunks)": png_open,
        "PNG decode (Pillow: open + load)": png_decode,
        "resize 256->224 (not on the 224 path)": (
            lambda i: big.resize((224, 224), Image.Resampling.BILINEAR)
        ),
        "tensor build (tobytes + frombuffer)": tensor,
        "prepare_sample total (base64..tensor)": lambda i: model.prepare_sample(requests[i % n]),
        "stack (batch of 64; GPUs only since forward_tiles)": (
            lambda i: stack_tiles([tiles[(i + j) % n] for j in range(64)], keep_layout=True)
        ),
        # What the clients run (ServerModel.forward_tiles: no stack on a CPU), unsharded.
        "forward (64 tiles, incl. normalize)": (
            lambda i: model.forward_tiles(list(batch64[i % 4]), "predict")
        ),
        "forward (batch of 1)": lambda i: model.forward_batch(tiles[i % n].unsqueeze(0), "predict"),
        "split (.tolist, batch of 64)": lambda i: outputs.split(),
        "postprocess + JSON out": (
            lambda i: model.postprocess(
                requests[i % 64], samples[i % 64], "predict"
            ).model_dump_json()
        ),
    }
    for decoder in png.available_decoders():
        name = _FAST_PNG_STEPS[decoder.name]
        steps[name] = partial(lambda decode, i: decode(raws[i % n]), decoder.decode)
    # Without the `fast` extra, pybase64 is absent too and the step above times binascii again.
    return {name: steps[name] for name in STEP_NAMES if name in steps}


#: the steps one request goes through in the explicit loop, in order (prepare_sample total
#: stands for base64 .. tensor build)
PIPELINE = (
    "JSON parse + validate (pydantic)",
    "prepare_sample total (base64..tensor)",
    "forward (64 tiles, incl. normalize)",
    "split (.tolist, batch of 64)",
    "postprocess + JSON out",
)


def step_costs(model: Any, bodies: list[str], log: Log) -> list[dict[str, Any]]:
    from .overhead import OverheadConfig, measure_overhead

    rows: list[dict[str, Any]] = []
    for name, fn in step_functions(model, bodies).items():
        per_call = STEP_NAMES[name][1]
        calls = 2 if name.startswith("forward (64") else 4 if per_call == 64 else 60
        fn(0)
        wall, cpu = _per_call(fn, calls)
        row = {
            "step": name,
            "us_per_tile": 1e6 * wall / per_call,
            "cpu_us_per_tile": 1e6 * cpu / per_call,
        }
        rows.append(row)
        wall_us, cpu_us = row["us_per_tile"], row["cpu_us_per_tile"]
        log(f"[profile] {name}: {wall_us:.0f} µs/tile wall, {cpu_us:.0f} µs CPU")
    noop = measure_overhead("scheduler-asyncio", OverheadConfig(requests=5000, concurrency=64))
    rows.insert(
        next(i for i, row in enumerate(rows) if row["step"].startswith("forward (64")),
        {
            "step": "scheduler (no-op batch fn, 64 in flight, asyncio)",
            "us_per_tile": 1e6 / noop.throughput,
            "cpu_us_per_tile": None,
        },
    )
    return rows


def cpu_budget(steps: list[dict[str, Any]]) -> dict[str, float]:
    """What 2 cores allow: the explicit loop runs the steps one after another (wall times add),
    perfect pipelining runs them side by side (CPU times add, spread over every core)."""
    by_name = {row["step"]: row for row in steps}
    wall = sum(by_name[name]["us_per_tile"] for name in PIPELINE)
    cpu = sum(by_name[name]["cpu_us_per_tile"] for name in PIPELINE)
    from ..cpus import usable_cpus

    cores = usable_cpus()
    forward = by_name["forward (64 tiles, incl. normalize)"]["us_per_tile"]
    explicit = 1e6 / wall
    ceiling = min(cores * 1e6 / cpu, 1e6 / forward)
    return {
        "cores": cores,
        "sequential_us_per_tile": wall,
        "cpu_us_per_tile": cpu,
        "explicit_tiles_s": explicit,
        "pipelined_ceiling_tiles_s": ceiling,
        "ceiling_ratio": ceiling / explicit,
    }


# -- 3: sampling profile -------------------------------------------------------------------------

_LINE_STEPS: dict[str, dict[int, str]] = {}

#: per source file of ours: (text on a line -> the step that line is) for C calls py-spy cannot
#: see into; found in the source at run time, so that edits to those files do not break it.
_LINE_PATTERNS: dict[str, tuple[tuple[str, str], ...]] = {
    "models/imaging.py": (
        ("a2b_base64", "base64 decode"),
        ("b64decode(", "base64 decode"),
        ("fast.decode(", "PNG decode"),
        ("frombuffer", "tensor build"),
        ("ascontiguousarray(", "tensor build"),
        ("_open(raw)", "PNG decode"),  # Pillow's open of a PNG the fast decoders don't take
        (".load()", "PNG decode"),
    ),
    "clients/inprocess.py": ((".split()", "split (.tolist)"),),
}


def _line_steps(suffix: str) -> dict[int, str]:
    if suffix not in _LINE_STEPS:
        import histoinfer

        path = Path(histoinfer.__file__).parent / suffix
        source = path.read_text(encoding="utf-8").splitlines()
        found: dict[int, str] = {}
        for number, text in enumerate(source, start=1):
            for pattern, step in _LINE_PATTERNS[suffix]:
                if pattern in text:
                    found.setdefault(number, step)
        _LINE_STEPS[suffix] = found
    return _LINE_STEPS[suffix]


def _frame_parts(frame: str) -> tuple[str, str, int]:
    """``"Class.func (path/file.py:12)"`` -> (func, path, line); ``func`` without its class."""
    qualified, _, rest = frame.partition(" (")
    location = rest.rstrip(")")
    path, _, line = location.rpartition(":")
    try:
        number = int(line)
    except ValueError:
        number, path = 0, location
    return qualified.rsplit(".", 1)[-1], path, number


_PIL_STEPS = {"tobytes": "tensor build", "resize": "resize", "convert": "RGB convert"}
_FUNCTION_STEPS = {
    "parse_request": "JSON parse + validate",
    "model_validate_json": "JSON parse + validate",
    "postprocess": "postprocess + JSON out",
    "model_dump_json": "postprocess + JSON out",
    "_finish": "postprocess + JSON out",
    "forward_batch": "forward",
    "forward_tiles": "forward",
    "_run_program": "forward",
}
_IDLE_LEAVES = frozenset({"select", "poll", "get_events", "wait", "get"})
_LOOP_PARTS = ("anyio/", "asyncio/", "trio/", "concurrent/", "threading", "selectors")


def classify_stack(frames: list[str]) -> str:
    """The step a sampled stack (root first) belongs to, by its deepest recognizable frame."""
    names = [_frame_parts(frame)[0] for frame in frames]
    if names and names[-1] in _IDLE_LEAVES:
        return "idle wait (select, queue)"
    for frame in reversed(frames):
        func, path, line = _frame_parts(frame)
        if "PIL/" in path:
            return _PIL_STEPS.get(func, "PNG decode")
        for suffix in _LINE_PATTERNS:
            if path.endswith(suffix) and line in _line_steps(suffix):
                return _line_steps(suffix)[line]
        if func in _FUNCTION_STEPS:
            return _FUNCTION_STEPS[func]
        if func == "split" and path.endswith("models/base.py"):
            return "split (.tolist)"
        if path.endswith("models/imaging.py"):
            return "PNG decode"
        if "histoinfer/batching/" in path:
            return "scheduler"
        if "histoinfer/clients/" in path or "histoinfer/server/" in path:
            return "client glue"
        if "histoinfer/bench/" in path:
            return "benchmark driver"
    if "call_soon_threadsafe" in names or "run_sync_soon" in names:
        return "worker -> loop handoff"
    for frame in reversed(frames):
        if any(part in _frame_parts(frame)[1] for part in _LOOP_PARTS):
            return "event loop / anyio"
    return "other"


def _read_collapsed(path: Path) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    if not path.exists():
        return stacks
    for line in path.read_text(encoding="utf-8").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            frames = tuple(
                f for f in stack.split(";") if not f.startswith(("thread (", "process "))
            )
            stacks[frames] += int(count)
    return stacks


def _py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if Path(found).exists() else None


def _record(
    pid: int, seconds: float, rate: int
) -> tuple[Counter[tuple[str, ...]], Counter[tuple[str, ...]]] | str:
    """Two py-spy recordings at once: GIL holder only, and every running thread."""
    py_spy = _py_spy()
    if py_spy is None:
        return "py-spy is not installed (pip install py-spy)"
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for kind, extra in (("gil", ["--gil"]), ("cpu", [])):
            out = Path(tmp) / f"{kind}.txt"
            command = [
                py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking",
                "-o", str(out), *extra,
            ]  # fmt: skip
            procs.append(
                (out, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            )
        results = []
        for out, proc in procs:
            _, err = proc.communicate()
            if not out.exists():
                return f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}"
            results.append(_read_collapsed(out))
    return results[0], results[1]


def _spawn(
    mode: str, checkpoint: Path, workdir: Path, seconds: float, seed: int
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "histoinfer.bench.profile",
            "--mode",
            mode,
            "--checkpoint",
            str(checkpoint),
            "--workdir",
            str(workdir),
            "--seconds",
            str(seconds),
            "--seed",
            str(seed),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def _profile_child(
    mode: str,
    checkpoint: Path,
    workdir: Path,
    seconds: float,
    record_s: float,
    rate: int,
    seed: int,
) -> tuple[Counter[tuple[str, ...]], Counter[tuple[str, ...]]] | str:
    child = _spawn(mode, checkpoint, workdir, seconds, seed)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if "READY" not in line:
            return f"the profiling workload did not start ({line.strip()!r})"
        return _record(child.pid, record_s, rate)
    finally:
        child.kill()
        child.wait()


def gil_by_step(
    checkpoint: Path, workdir: Path, log: Log, step_seconds: float, rate: int = 250, seed: int = 0
) -> dict[str, Any]:
    """Each step alone in a loop on one thread: the share of its running time it holds the GIL."""
    total = step_seconds * len(STEP_NAMES)
    recorded = _profile_child("steps", checkpoint, workdir, step_seconds, total, rate, seed)
    if isinstance(recorded, str):
        return {"skipped": recorded}
    gil, cpu = recorded
    shares: dict[str, float | None] = {}
    for name, (function, _) in STEP_NAMES.items():
        held = sum(
            n for frames, n in gil.items() if any(f.startswith(function + " ") for f in frames)
        )
        running = sum(
            n for frames, n in cpu.items() if any(f.startswith(function + " ") for f in frames)
        )
        shares[name] = held / running if running >= 20 else None
        log(f"[profile] GIL held {held}/{running} samples in {name}")
    return {"step_seconds": step_seconds, "rate_hz": rate, "gil_share": shares}


def sampling_profile(
    checkpoint: Path, workdir: Path, log: Log, seconds: float = 6.0, rate: int = 200, seed: int = 0
) -> dict[str, Any]:
    """py-spy over a child running dynamic batching (asyncio, 512 in flight)."""
    recorded = _profile_child("dynamic", checkpoint, workdir, 2 * seconds + 30, seconds, rate, seed)
    if isinstance(recorded, str):
        return {"skipped": recorded}
    result: dict[str, Any] = {"seconds": seconds, "rate_hz": rate}
    for kind, stacks in zip(("gil", "cpu"), recorded, strict=True):
        counts: Counter[str] = Counter()
        for frames, n in stacks.items():
            counts[classify_stack(list(frames))] += n
        total = sum(counts.values())
        result[kind] = {
            "samples": total,
            # --gil samples only the GIL holder: samples per tick = share of the wall it is held.
            "share_of_wall": total / (seconds * rate),
            "steps": {k: v / total for k, v in counts.most_common()} if total else {},
        }
        log(f"[profile] py-spy {kind}: {total} samples")
    return result


def _loop(fn: Callable[[int], object], until: float) -> None:
    i = 0
    while time.perf_counter() < until:
        fn(i)
        i += 1


def _workload(mode: str, checkpoint: Path, workdir: Path, seconds: float, seed: int) -> None:
    """The profiled child. ``dynamic``: dynamic batching on asyncio, 512 in flight, until
    ``seconds`` pass. ``steps``: each step alone for ``seconds``, in a function named after it."""
    import anyio

    from ..clients.inprocess import InProcessClient
    from ..models import build_server_model
    from .measure import drive_async
    from .runner import load_bodies

    model = build_server_model("h1", checkpoint)
    bodies = load_bodies(512 if mode == "dynamic" else 128, seed, workdir, lambda _: None)
    if mode == "steps":
        functions = step_functions(model, bodies)
        print("READY", flush=True)
        for name, fn in functions.items():
            code = _loop.__code__
            function_name = STEP_NAMES[name][0]
            named = types.FunctionType(
                code.replace(co_name=function_name, co_qualname=function_name), globals()
            )
            named(fn, time.perf_counter() + seconds)
        return
    with InProcessClient(model) as client:
        anyio.run(drive_async, client.predict_async, bodies[:128], 64)  # warm-up
        print("READY", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            anyio.run(drive_async, client.predict_async, bodies, 512)


# -- the suite -----------------------------------------------------------------------------------


def run_profile(cfg: Any, log: Log) -> dict[str, Any]:
    from ..models import build_server_model
    from .runner import ensure_checkpoint, load_bodies

    workdir = Path(cfg.workdir)
    checkpoint = ensure_checkpoint("tiny", workdir, log, getattr(cfg, "dtype", "float32"))
    model = build_server_model("h1", checkpoint)
    bodies = load_bodies(128, cfg.seed, workdir, log)
    sample = json.loads(bodies[0])
    steps = step_costs(model, bodies, log)
    budget = cpu_budget(steps)
    gil = gil_by_step(checkpoint, workdir, log, 0.8 if cfg.quick else 1.5, seed=cfg.seed)
    shares = gil.get("gil_share", {})
    for row in steps:
        row["gil_share"] = shares.get(row["step"])
    return {
        "body_bytes": len(bodies[0]),
        "png_bytes": len(base64.b64decode(sample["image_data"])),
        "torch_threads": torch.get_num_threads(),
        "steps": steps,
        "cpu_budget": budget,
        "gil_by_step": gil,
        "sampling": sampling_profile(
            checkpoint, workdir, log, seconds=4.0 if cfg.quick else 8.0, seed=cfg.seed
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="profiling workload (used by histoinfer bench)")
    parser.add_argument("--mode", choices=["dynamic", "steps"], default="dynamic")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _workload(args.mode, args.checkpoint, args.workdir, args.seconds, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
