"""Smoke tests of the benchmark harness: it runs, and its outputs are well-formed.

Tiny sizes and no timing assertions: timings on a shared CI machine mean nothing. What is
checked is that every suite runs, every path answers every request with its own response, and
the JSON, Markdown and PNG outputs are produced and consistent.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from histoinfer.bench.bodies import make_bodies
from histoinfer.bench.children import open_path
from histoinfer.bench.cli import main as bench_main
from histoinfer.bench.isolation import Isolated, Unavailable
from histoinfer.bench.loopback import http_unavailable, parse_metrics
from histoinfer.bench.measure import (
    NATIVE_THREAD,
    Sample,
    ThreadClock,
    check_responses,
    closed_loop_latencies,
    cpu_split,
    percentile,
    thread_cpu_clocks,
)
from histoinfer.bench.names import PATH_NAMES
from histoinfer.bench.profile import classify_stack
from histoinfer.bench.report import write_outputs
from histoinfer.bench.runner import (
    BenchConfig,
    PathSpec,
    Samples,
    noise_floor,
    quick_config,
    reference_indices,
    run_bench,
    suspect_rows,
    throughput_checks,
    verdict,
)
from histoinfer.models import ServerModel, png, shards

#: the smoke test's paths: all but the slow to start (HTTP) and the many-threaded
PATHS = tuple(p for p in PATH_NAMES if p not in ("http", "sync-threads", "bs1-asyncio", "bs1-trio"))


@pytest.fixture
def workdir(tmp_path: Path, tiny_dir: Path) -> Path:
    """A bench workdir holding the session's tiny checkpoint (no second export)."""
    work = tmp_path / "work"
    shutil.copytree(tiny_dir, work / "h1-tiny")
    return work


def test_bodies_are_seeded_distinct_and_valid() -> None:
    from histoinfer.schema import parse_request

    a, b = make_bodies(4, seed=3), make_bodies(4, seed=3)
    assert a == b
    assert len(set(a)) == 4
    assert make_bodies(2, seed=4) != a[:2]
    for i, body in enumerate(a):
        request = parse_request(body)
        assert (request.patch_idx, request.width, request.height) == (i, 224, 224)


def test_check_responses_catches_crossed_and_missing() -> None:
    ok = ['{"output":[1.0],"patch_idx":0}', '{"output":[2.0],"patch_idx":1}']
    check_responses(ok, "p")
    with pytest.raises(RuntimeError, match="does not answer"):
        check_responses(list(reversed(ok)), "p")
    with pytest.raises(RuntimeError, match="no response"):
        check_responses([ok[0], None], "p")


def test_cpu_split_attributes_each_thread_to_its_role() -> None:
    main = threading.main_thread().native_id
    assert main is not None
    clock = ThreadClock
    before = {
        main: clock("MainThread", 1.0, 1),
        2: clock("histoinfer-device-cpu", 5.0, 2),
        3: clock("w", 0.5, 3),
        5: clock(NATIVE_THREAD, 2.0, 5),  # torch's OpenMP worker: forward passes
        6: clock("ended", 9.0, 6),
        7: clock("histoinfer-device-cpu/helper-3", 0.5, 7),
    }
    after = {
        main: clock("MainThread", 1.25, 1),
        2: clock("histoinfer-device-cpu", 5.5, 2),
        3: clock("w", 0.75, 3),
        4: clock("histoinfer-device-cpu/helper-1", 0.125, 4),  # started meanwhile: all of it
        5: clock(NATIVE_THREAD, 2.25, 5),
        6: clock("histoinfer-device-cpu/helper-2", 0.0625, 60),  # a new thread, an old id
        7: clock(NATIVE_THREAD, 0.75, 7),  # ending: Python no longer names it
    }
    split = cpu_split(before, after, process_s=2.0)
    assert split == {"forward": 1.1875, "main": 0.25, "other": 0.5625}
    # a server's CPU is its own role; what the threads do not account for is "other"
    assert cpu_split(before, after, process_s=2.5, server_s=3.0) == {
        "forward": 1.1875,
        "main": 0.25,
        "other": 1.0625,
        "server": 3.0,
    }
    # a thread whose clock went back is not the thread it was
    assert cpu_split({3: clock("w", 4.0, 3)}, {3: clock("w", 1.0, 3)}, 1.0) == {
        "forward": 0.0,
        "main": 0.0,
        "other": 1.0,
    }
    assert cpu_split(None, after, process_s=1.0) is None
    # a path whose event loop runs in a thread of its own (HTTP): that thread is its "main"
    looped = {**after, 3: clock("w", 1.0, 3)}
    assert cpu_split(before, looped, process_s=2.0, main_thread=3) == {
        "forward": 1.1875,
        "main": 0.5,
        "other": 0.3125,
    }


@pytest.mark.skipif(sys.platform != "linux" or torch.get_num_threads() < 2, reason="OpenMP team")
def test_thread_clocks_see_torchs_own_workers() -> None:
    """A pass on torch's team runs partly on threads Python does not know: they are listed."""
    main = threading.main_thread().native_id
    with torch.inference_mode():
        torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel op: the team exists
    clocks = thread_cpu_clocks()
    assert clocks is not None and main in clocks
    assert any(c.name == NATIVE_THREAD for c in clocks.values())


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no thread clocks")
def test_thread_clocks_count_a_device_threads_cpu_as_forward() -> None:
    go, burnt, leave = threading.Event(), threading.Event(), threading.Event()

    def device() -> None:
        go.wait()
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        burnt.set()
        leave.wait()

    worker = threading.Thread(target=device, name="histoinfer-device-test")
    worker.start()
    try:
        before, process0 = thread_cpu_clocks(), time.process_time()
        go.set()
        assert burnt.wait(20)
        split = cpu_split(before, thread_cpu_clocks(), time.process_time() - process0)
    finally:
        leave.set()
        worker.join()
    assert split is not None
    assert split["forward"] >= 0.045
    assert split["main"] < 0.045  # this thread only waited


def test_parse_metrics_sums_over_labels() -> None:
    text = "\n".join(
        [
            "# HELP histoinfer_batch_size samples per batch",
            'histoinfer_batch_size_count{mode="predict"} 3',
            'histoinfer_batch_size_sum{mode="predict"} 96',
            'histoinfer_batch_size_sum{mode="embed"} 4',
            'histoinfer_forward_seconds_sum{mode="predict"} 0.5',
            "histoinfer_queue_depth 0",
        ]
    )
    assert parse_metrics(text) == {"batches": 3.0, "samples": 100.0, "forward_s": 0.5}
    busy = 'histoinfer_forward_busy_seconds_total{model="h1",mode="predict"} 2.25'
    created = 'histoinfer_forward_busy_seconds_created{model="h1",mode="predict"} 1.7e9'
    assert parse_metrics("\n".join([text, busy, created]))["forward_s"] == 2.25


def test_classify_stack() -> None:
    def frame(func: str, path: str, line: int = 1) -> str:
        return f"{func} ({path}:{line})"

    assert (
        classify_stack(
            [frame("run", "threading.py"), frame("load", "site-packages/PIL/ImageFile.py")]
        )
        == "PNG decode"
    )
    assert classify_stack([frame("parse_request", "histoinfer/schema.py")]) == (
        "JSON parse + validate"
    )
    assert classify_stack([frame("ServerModel.forward_batch", "histoinfer/models/base.py")]) == (
        "forward"
    )
    assert classify_stack([frame("Image.tobytes", "PIL/Image.py")]) == "tensor build"
    assert classify_stack([frame("run", "asyncio/base.py"), frame("select", "selectors.py")]) == (
        "idle wait (select, queue)"
    )
    assert classify_stack([frame("_run_once", "asyncio/base_events.py")]) == "event loop / anyio"


def test_the_orchestrating_process_names_what_it_runs_without_importing_torch() -> None:
    # `histoinfer bench` (and its --help) must not spend ~5 s loading torch in the process that
    # only starts children and writes the report.
    code = (
        "import sys; from histoinfer import cli; from histoinfer.bench import cli as bench;"
        "argv = ['bench', '--quick']; parser = cli.build_parser();"
        "cli._configure_plugin(parser, argv); bench.config_from_args(parser.parse_args(argv));"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
    # ... so it keeps the names, which must be those of what the children run.
    from histoinfer.bench import names
    from histoinfer.bench.paths import PATHS
    from histoinfer.cli import build_parser
    from histoinfer.models.h1 import REFERENCE_DTYPES

    assert tuple(PATHS) == names.PATH_NAMES
    assert tuple(names.PATH_DESCRIPTIONS) == names.PATH_NAMES  # the report's legend: each one
    assert REFERENCE_DTYPES == names.REFERENCE_DTYPES
    # The top-level `histoinfer export` keeps a literal list too (for every command's start-up).
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    [dtype] = [a for a in sub.choices["export"]._actions if a.dest == "dtype"]
    assert tuple(dtype.choices or ()) == REFERENCE_DTYPES


def test_the_http_paths_process_loads_no_model(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from histoinfer.bench import children
    from histoinfer.bench.paths import HttpLoopback

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the HTTP path's process loaded a model: the server has one")

    monkeypatch.setattr(children, "build_server_model", no_model)
    monkeypatch.setattr(HttpLoopback, "unavailable", lambda self: None)
    monkeypatch.setattr(HttpLoopback, "open", lambda self: None)  # no server: not measured here
    (workdir / "bodies-4-seed0.json").write_text(json.dumps(make_bodies(4)))
    checkpoint = str(workdir / "h1-tiny" / "model.pt2")
    spec = PathSpec("tiny", "http", checkpoint, 4, 0, str(workdir), 4, 5.0)
    opened = open_path(spec)
    assert opened.path.ctx.model is None and len(opened.bodies) == 4
    with pytest.raises(RuntimeError, match="no model loaded"):
        opened.path.ctx.server_model  # noqa: B018 - the property raises
    with pytest.raises(AssertionError, match="loaded a model"):
        open_path(replace(spec, name="explicit"))


def _measured_over_http(server: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The HTTP path measured at 4 tiles against ``server`` (a stand-in for ServerProcess)
    and a client answering at once: ``(opened path, sample)``."""
    import anyio.from_thread

    from histoinfer.bench.paths import HttpLoopback

    class Client:
        async def predict_async(self, body: str) -> str:
            return json.dumps({"patch_idx": json.loads(body)["patch_idx"]})

        async def aclose(self) -> None:
            pass

    def fake_open(self: HttpLoopback) -> None:
        self.server = server
        self._client = Client()  # type: ignore[assignment]
        self._counters = {}
        self._portal_context = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._portal_context.__enter__()

    monkeypatch.setattr(HttpLoopback, "unavailable", lambda self: None)
    monkeypatch.setattr(HttpLoopback, "open", fake_open)
    (workdir / "bodies-4-seed0.json").write_text(json.dumps(make_bodies(4)))
    checkpoint = str(workdir / "h1-tiny" / "model.pt2")
    opened = open_path(PathSpec("tiny", "http", checkpoint, 4, 0, str(workdir), 4, 5.0))
    try:
        return opened, opened.measure(4, 4)
    finally:
        opened.close()


def test_the_http_paths_server_counters_are_read_outside_its_cpu_clocks(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading /metrics costs the bench process CPU (a new httpx client each time): read
    inside the CPU window, it was nearly all of the HTTP path's "other" CPU at 32 tiles."""

    spin_s = 0.2

    class Server:
        reads = 0

        def metrics(self) -> dict[str, float]:
            end = time.process_time() + spin_s  # what a read costs, made large
            while time.process_time() < end:
                pass
            self.reads += 1
            return {"batches": 10.0 * self.reads, "samples": 40.0 * self.reads, "forward_s": 0.5}

        def cpu_s(self) -> float:
            return 0.0

        def close(self) -> None:
            pass

    opened, sample = _measured_over_http(Server(), workdir, monkeypatch)
    assert opened.path.server.reads == 2  # type: ignore[attr-defined]
    assert sample.batches == 10 and sample.samples == 40 and sample.forward_busy_s == 0.0
    assert sample.cpu_s is not None and sample.cpu_s < spin_s


def test_the_http_paths_cpu_is_unknown_where_the_servers_cannot_be_read(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without /proc (Windows, macOS) the server's CPU read 0: the HTTP path looked as cheap
    as its client alone. Unknown now, and said so."""

    from histoinfer.bench.loopback import _proc_cpu_s
    from histoinfer.bench.runner import _cpu_said

    assert _proc_cpu_s(str(workdir / "no-proc" / "stat")) is None

    class Server:
        def metrics(self) -> dict[str, float]:
            return {}

        def cpu_s(self) -> float | None:
            return None

        def close(self) -> None:
            pass

    _opened, sample = _measured_over_http(Server(), workdir, monkeypatch)
    assert sample.cpu_s is None and sample.cpu_ms_per_tile is None
    assert sample.cpu_ms_per_tile_of("server") is None
    assert _cpu_said(sample.cpu_ms_per_tile) == "   n/a" and _cpu_said(1.5) == "  1.50"


def test_the_load_average_is_na_where_the_platform_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows has no os.getloadavg: each progress line of a sweep raised AttributeError."""
    from histoinfer.bench.runner import _load_said

    assert re.fullmatch(r"\d+\.\d", _load_said()) or not hasattr(os, "getloadavg")
    monkeypatch.delattr(os, "getloadavg", raising=False)
    assert _load_said() == "n/a"


def test_http_path_reports_why_it_cannot_run() -> None:
    reason = http_unavailable()
    assert reason is None or (isinstance(reason, str) and reason)


@pytest.mark.timeout(90)
def test_run_bench_smoke_writes_json_markdown_and_plot(workdir: Path, tmp_path: Path) -> None:
    cfg = BenchConfig(
        models=("tiny",),
        paths=PATHS,
        levels=(1, 8),
        tiles=16,
        min_tiles=8,
        rounds=2,
        max_batch_size=8,
        suites=("throughput", "overhead", "latency"),
        modes=("predict",),  # every mode: test_modes_are_swept_and_the_targets_read_on_the_first
        overhead_levels=(8,),
        overhead_requests=400,
        lone_calls=3,
        workdir=str(workdir),
        isolate=False,  # one process: seven paths in seven processes is slow to start
    )
    lines: list[str] = []
    report = run_bench(cfg, lines.append, "test")
    out = tmp_path / "out"
    written = write_outputs(report, out)
    assert {p.name for p in written} == {"report.json", "report.md", "report.png"}

    data = json.loads((out / "report.json").read_text())
    rows = data["throughput"]["rows"]
    measured = {(r["path"], r["concurrency"]) for r in rows}
    skipped = {s["path"] for s in data["throughput"]["skipped"]}
    assert measured == {(p, c) for p in PATHS if p not in skipped for c in (1, 8)}
    for row in rows:
        assert row["rounds"] == 2
        assert row["throughput"] > 0
        assert [r["throughput"] for r in row["per_round"]] == pytest.approx(
            row["throughput_rounds"], abs=0.06
        )
        for measured_round in row["per_round"]:  # every round's own figures, kept
            assert 0 < measured_round["latency_ms"]["p50"] <= measured_round["latency_ms"]["p99"]
            assert measured_round["cpu_ms_per_tile"] > 0
        assert 0 < row["latency_ms"]["p50"] <= row["latency_ms"]["p99"]
        assert row["tiles"] == 8 if row["concurrency"] == 1 else row["tiles"] == 16
        assert row["cpu_ms_per_tile"] > 0
        split = row["cpu_ms_per_tile_by_role"]
        assert set(split) == {"forward", "main", "other"}  # no server among these paths
        assert all(v >= 0 for v in split.values())
    raw8 = next(r for r in rows if r["path"] == "raw" and r["concurrency"] == 8)
    assert raw8["mean_batch_size"] == 8
    dynamic = next(r for r in rows if r["path"] == "dynamic-asyncio" and r["concurrency"] == 8)
    assert dynamic["mean_batch_size"] is not None and dynamic["mean_batch_size"] >= 1
    # forward passes run on the device's thread; the event loop runs on the main thread
    assert dynamic["cpu_ms_per_tile_by_role"]["forward"] > 0
    assert dynamic["cpu_ms_per_tile_by_role"]["main"] > 0
    assert raw8["cpu_ms_per_tile_by_role"]["forward"] > 0
    assert 0 < dynamic["forward_busy"] <= 1

    checks = {(c["name"], c["issue"]) for c in data["throughput"]["checks"]}
    assert ("dynamic / explicit loop", "3") in checks
    assert ("trio / asyncio (dynamic)", "5") in checks
    for section in ("throughput", "overhead", "latency"):
        for check in data[section]["checks"]:
            assert check["met"] in (True, False, None)
            assert len(check["per_round"]) <= 2
    floors = data["throughput"]["noise_floor"]
    assert [f["concurrency"] for f in floors] == [1, 8]
    for floor in floors:  # the twin against the original, round by round
        twin = next(
            r
            for r in rows
            if r["path"] == "dynamic-asyncio-twin" and r["concurrency"] == floor["concurrency"]
        )
        assert twin["throughput"] > 0 and len(floor["per_round"]) == 2
        assert floor["spread"] == max(abs(1 - r) for r in floor["per_round"])
    variants = {r["variant"] for r in data["overhead"]["rows"]}
    assert {"scheduler-asyncio", "scheduler-trio"} <= variants
    assert {r["variant"] for r in data["latency"]["rows"]} == {
        "raw-forward-1",
        "raw-forward-1-hot",
        "pipeline-1",
        "dynamic-asyncio",
        "dynamic-trio",
    }

    for lone in data["latency"]["rows"]:
        assert 0 < lone["p50_ms"] <= lone["p95_ms"] <= lone["p99_ms"]
        assert len(lone["p95_ms_rounds"]) == len(lone["p99_ms_rounds"]) == 2

    md = (out / "report.md").read_text()
    # The libraries compared, as installed (anyio's read null: it has no __version__).
    assert data["environment"]["anyio"] == importlib.metadata.version("anyio")
    assert data["environment"]["async-batcher"] == importlib.metadata.version("async-batcher")
    assert f"anyio {data['environment']['anyio']}, trio " in md
    assert "| model | variant | p50 ms | p95 ms | p99 ms | p50 per round |" in md
    assert "nearest-rank" in md
    assert "| model | path | mode | in flight |" in md
    assert "of which forward / main / other |" in md
    assert "## Targets\n\nBounds the project set itself" in md
    assert "## Scheduler overhead" in md
    assert "## Noise floor" in md
    assert "| tiny | dynamic-trio | predict | 1 |" in md
    # Each path measured, said in a line (a reader of the report alone had only http's).
    legend = next(line for line in md.splitlines() if line.startswith("Paths: "))
    assert all(f"`{path}`: " in legend for path in {row["path"] for row in rows})
    assert "| tiny | dynamic-trio | predict | 8 |" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("round 2/2" in line for line in lines)


@pytest.mark.timeout(120)
def test_modes_are_swept_and_the_targets_read_on_the_first(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from histoinfer.cli import main

    out = tmp_path / "modes"
    args = ["bench", "--suites=throughput", "--paths=raw,explicit,dynamic-asyncio,asyncio-queue"]
    args += ["--modes=embed,predict_with_embedding", "--levels=4", "--tiles=8", "--rounds=1"]
    assert main([*args, f"--workdir={workdir}", f"--out={out}", "--quiet"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["modes"] == ["embed", "predict_with_embedding"]
    rows = data["throughput"]["rows"]
    assert {(r["path"], r["mode"]) for r in rows} == {
        (path, mode)
        for path in ("raw", "explicit", "dynamic-asyncio", "asyncio-queue")
        for mode in ("embed", "predict_with_embedding")
    }
    # Each client path counted its batches under the mode it ran (stats are per mode).
    for row in rows:
        assert row["mean_batch_size"] is not None and row["mean_batch_size"] >= 1, row
    [check] = [c for c in data["throughput"]["checks"] if c["issue"] == "3"]
    assert ", embed, " in check["detail"] and check["value"] is not None
    md = (out / "report.md").read_text()
    assert "| tiny | explicit | predict_with_embedding | 4 |" in md
    capsys.readouterr()
    assert main(["bench", "--modes=predict,guess", f"--workdir={workdir}", f"--out={out}"]) != 0
    assert "unknown modes: guess" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_cli_runs_and_reports(workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from histoinfer.cli import main

    out = tmp_path / "cli"
    code = main(
        [
            "bench",
            "--quick",
            "--suites=throughput",
            "--paths=raw,dynamic-asyncio",
            "--levels=4",
            "--tiles=8",
            "--rounds=1",
            f"--workdir={workdir}",
            f"--out={out}",
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "report.json" in printed
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["quick"] is True
    quick = quick_config()
    assert "dynamic-asyncio-twin" not in quick.paths  # --quick has no noise floor
    # ... nor the extras, but every path issue 5 names, and what the lone targets compare.
    named = {"raw", "explicit", "dynamic-asyncio", "dynamic-trio", "bs1-asyncio", "sync-threads"}
    assert named | {"http", "async-batcher", "asyncio-queue"} <= set(quick.paths)
    assert {"raw-forward-1", "raw-forward-1-hot", "pipeline-1", "dynamic-asyncio"} == set(
        quick.lone_variants
    )
    assert "--paths=raw,dynamic-asyncio" in data["command"]
    assert {r["path"] for r in data["throughput"]["rows"]} == {"raw", "dynamic-asyncio"}
    # Whether CPU passes were sharded changes every figure: the report says which it was.
    expected = shards.describe(torch.get_num_threads())
    assert data["environment"]["cpu_passes"] == expected
    assert f"CPU forward passes: {expected}." in (out / "report.md").read_text()
    # So does which PNG decoder ran (the `wuffs` extra's is ~25% cheaper than libspng's).
    decoders = [decoder.name for decoder in png.DECODERS] + ["Pillow"]
    assert data["environment"]["png_decoders"] == decoders
    assert f"first that takes a tile: {', '.join(decoders)}." in (out / "report.md").read_text()
    # And whether the program's graph ran in TorchScript's interpreter (models/scripted.py).
    assert data["environment"]["program_runner"] == {
        "tiny": "TorchScript interpreter, channels-last batches"
    }
    report = (out / "report.md").read_text()
    assert "The program runs as: TorchScript interpreter, channels-last batches." in report


def test_script_entry_point_rejects_unknown_suite(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In one line, as histoinfer bench says it.
    assert bench_main(["--suites=nope", f"--workdir={workdir}"], prog="bench-test") == 1
    assert capsys.readouterr().err.startswith("bench-test: error: unknown suites: nope")


def refuse(reason: str) -> None:
    """A factory for an ``Isolated`` child (imported there by name): the path cannot run."""
    raise Unavailable(reason)


def break_down() -> None:
    raise ValueError("the model file is corrupt")


class Sleeper:
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        pass


def sleeper() -> Sleeper:
    return Sleeper()


@pytest.mark.timeout(120)
def test_isolated_paths_run_and_are_measured_in_processes_of_their_own(workdir: Path) -> None:
    load = [str(workdir / "h1-tiny" / "model.pt2"), 8, 0, str(workdir), 4, 5.0]
    bench_bodies = make_bodies(8)
    (workdir / "bodies-8-seed0.json").write_text(json.dumps(bench_bodies))
    handles = [
        Isolated(open_path, PathSpec("tiny", "raw", *load)),  # the function, or its name:
        Isolated("histoinfer.bench.children:open_path", PathSpec("tiny", "explicit", *load)),
    ]
    try:
        for handle in handles:
            handle.wait_ready()
            handle.wait_ready(timeout=1)  # answered already: returns at once
            assert handle.unavailable is None
            assert handle.info["pid"] == handle.pid
        pids = {h.pid for h in handles}
        assert len(pids) == 2 and os.getpid() not in pids
        for handle in handles:
            sample = handle.call("measure", 8, 4, timeout=60)
            assert sample.tiles == 8 and len(sample.latencies_s) == 8
            assert sample.cpu_s is not None and sample.cpu_s > 0  # counted in the child
        with pytest.raises(RuntimeError, match="measure failed in the bench child process"):
            handles[0].call("measure", 8, 0, timeout=60)  # chunks of 0 tiles: its own error
        assert handles[0].call("measure", 4, 4, timeout=60).tiles == 4  # and it still serves
    finally:
        for handle in handles:
            handle.close()
    for handle in handles:
        assert not handle._process.is_alive()


@pytest.mark.timeout(120)
def test_isolated_children_report_refusals_and_failures_to_start() -> None:
    refused = Isolated(refuse, "no GPU here")
    broken = Isolated(break_down)
    refused.wait_ready()
    assert refused.unavailable == "no GPU here"
    with pytest.raises(
        RuntimeError, match="failed to start: ValueError: the model file is corrupt"
    ):
        broken.wait_ready()


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(pid, SIGINT) terminates on Windows")
def test_ctrl_c_is_left_to_the_parent_which_closes_its_children(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C reaches the whole process group: a child interrupted too printed its own
    KeyboardInterrupt traceback beside "histoinfer: interrupted" (a user trial). The parent
    decides; the child answers and closes when told."""
    handle = Isolated(sleeper)
    handle.wait_ready()
    assert handle.pid is not None
    os.kill(handle.pid, signal.SIGINT)  # while it waits for a call, and while it runs one
    handle.call("nap", 0.0)
    handle._conn.send(("call", "nap", (0.5,)))
    time.sleep(0.2)
    os.kill(handle.pid, signal.SIGINT)
    handle.close()  # asks; the child answers the nap, then closes
    assert handle._process.exitcode == 0
    assert "KeyboardInterrupt" not in capfd.readouterr().err


class _Interrupted(Exception):
    """What Ctrl-C raises in the parent, standing in for KeyboardInterrupt (which pytest
    takes as the user stopping the whole run)."""


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform == "win32", reason="no SIGALRM or setitimer on Windows")
def test_a_child_whose_call_was_interrupted_is_stopped_at_once() -> None:
    """Closed as the interrupt unwinds, a child still busy with the interrupted call was given
    30 s to answer it: Ctrl-C took that long to end the bench."""
    handle = Isolated(sleeper)
    handle.wait_ready()

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupted):
            handle.call("nap", 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    started = time.monotonic()
    handle.close()
    assert time.monotonic() - started < 10
    assert not handle._process.is_alive()


@pytest.mark.timeout(120)
def test_an_isolated_child_that_does_not_answer_in_time_is_killed() -> None:
    handle = Isolated(sleeper)
    handle.wait_ready()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer nap in 1 s"):
        handle.call("nap", 60, timeout=1)
    assert time.monotonic() - started < 30
    assert not handle._process.is_alive()


def test_the_noise_floor_is_the_twin_over_the_original_round_by_round() -> None:
    def sample(tiles_per_s: float) -> Sample:
        return Sample(tiles=100, wall_s=100 / tiles_per_s, latencies_s=[0.1])

    cfg = BenchConfig(levels=(8,), modes=("predict",))
    samples: Samples = {
        ("tiny", "dynamic-asyncio", "predict", 8): [sample(500), sample(400), sample(600)],
        ("tiny", "dynamic-asyncio-twin", "predict", 8): [sample(510), sample(380), sample(600)],
    }
    [floor] = noise_floor(samples, cfg)
    assert floor["per_round"] == pytest.approx([1.02, 0.95, 1.0])
    assert floor["median"] == pytest.approx(1.0) and floor["spread"] == pytest.approx(0.05)
    assert noise_floor({}, cfg) == []  # the twin not measured: no floor


def test_a_target_is_decided_only_when_every_round_falls_on_one_side_of_it() -> None:
    def sample(tiles_per_s: float) -> Sample:
        return Sample(tiles=100, wall_s=100 / tiles_per_s, latencies_s=[0.1])

    cfg = BenchConfig(levels=(8,), modes=("predict",), paths=("explicit", "dynamic-asyncio"))
    samples: Samples = {
        ("tiny", "dynamic-asyncio", "predict", 8): [sample(500), sample(400), sample(600)],
        ("tiny", "explicit", "predict", 8): [sample(400), sample(320), sample(400)],
    }
    checks = {(c.name, c.issue): c.as_dict() for c in throughput_checks(samples, cfg)}
    near = checks[("dynamic / explicit loop", "5")]  # rounds 1.25, 1.25, 1.5 against 1.3
    far = checks[("dynamic / explicit loop", "3")]  # the same against 1.0
    assert near["value"] == pytest.approx(1.25) and near["met"] is False
    assert near["rounds_met"] == 1 and near["decided"] is False
    assert verdict(near) == "not met by the median; met in 1 of 3 rounds: not decided"
    # Three rounds on one side happen 1 time in 4 by chance: too few to decide.
    assert far["met"] is True and far["rounds_met"] == 3 and far["decided"] is False
    assert verdict(far) == "met in every round (3 of 3); too few rounds to decide"
    five = [sample(500)] * 5
    samples[("tiny", "dynamic-asyncio", "predict", 8)] = five
    samples[("tiny", "explicit", "predict", 8)] = [sample(400)] * 5
    checks = {(c.name, c.issue): c.as_dict() for c in throughput_checks(samples, cfg)}
    assert verdict(checks[("dynamic / explicit loop", "3")]) == (
        "met in every round (5 of 5): decided"
    )
    assert verdict(checks[("dynamic / explicit loop", "5")]) == (
        "not met in any round (0 of 5): decided"  # said (a user trial read it as undecided)
    )
    samples[("tiny", "explicit", "predict", 8)] = []
    missing = throughput_checks(samples, cfg)[0].as_dict()
    assert missing["decided"] is None and verdict(missing) == "not measured"


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 21)]  # 1..20, shuffled order must not matter
    values.reverse()
    assert percentile(values, 0.5) == 10.0  # ceil(0.5 * 20) = the 10th smallest
    assert percentile(values, 0.95) == 19.0  # 0.95 * 20 is 19.000000000000004 in floats
    assert percentile(values, 0.99) == 20.0  # of fewer than 100: the slowest one
    assert percentile(list(map(float, range(1, 33))), 0.95) == 31.0  # ceil(30.4)
    assert percentile([3.0], 0.0) == 3.0 and percentile([], 0.5) == 0.0


def test_chunked_paths_latencies_count_the_wait_behind_earlier_chunks() -> None:
    # 4 requests, answered in chunks of 2 at t=1 and t=3, measured from t=0.
    done = [1.0, 1.0, 3.0, 3.0]
    # All 4 in flight at once (a burst): the second chunk waited for the first.
    assert closed_loop_latencies(0.0, done, 4) == [1.0, 1.0, 3.0, 3.0]
    # 2 in flight: requests 2 and 3 were sent when 0 and 1 were answered.
    assert closed_loop_latencies(0.0, done, 2) == [1.0, 1.0, 2.0, 2.0]


def test_an_unevaluated_targets_disturbed_round_is_still_said() -> None:
    # An own checkpoint's ratios are read all the same: a round far off is flagged (a user trial).
    check = {"not_evaluated": "own checkpoint", "per_round": [0.9, 0.02, 0.92], "disturbed": [1]}
    said = verdict(check | {"met": None, "issue": "5", "rounds_met": None})
    assert said == "not evaluated (own checkpoint); disturbed round 2 (0.02)"
    assert verdict(check | {"disturbed": [], "met": None}) == "not evaluated (own checkpoint)"


def test_a_disturbed_round_is_flagged_and_decides_nothing() -> None:
    def sample(tiles_per_s: float) -> Sample:
        return Sample(tiles=100, wall_s=100 / tiles_per_s, latencies_s=[0.1])

    cfg = BenchConfig(levels=(8,), modes=("predict",), paths=("explicit", "dynamic-asyncio"))
    samples: Samples = {  # round 2's explicit loop ran while the machine was taken away
        ("tiny", "dynamic-asyncio", "predict", 8): [sample(500)] * 5,
        ("tiny", "explicit", "predict", 8): [sample(400), sample(40), *[sample(400)] * 3],
    }
    far = next(c.as_dict() for c in throughput_checks(samples, cfg) if c.issue == "3")
    assert far["rounds_met"] == 5 and far["disturbed"] == [1] and far["decided"] is False
    assert verdict(far) == "met in every round (5 of 5); disturbed round 2 (12.50): not decided"
    rows = [
        {"model": "tiny", "path": p, "mode": "predict", "concurrency": 8, "in_flight": 8}
        | {"throughput": tp, "throughput_rounds": rounds}
        for p, tp, rounds in (
            ("raw", 100.0, [100.0, 100.0, 100.0]),
            ("explicit", 90.0, [90.0, 20.0, 91.0]),
            ("dynamic-asyncio", 101.0, [101.0, 99.0, 102.0]),
            # Two rounds slowed, one clean: the clean one is not the disturbed one (a user
            # trial's note called it "the machine, not the path").
            ("bs1-asyncio", 30.0, [30.0, 29.0, 95.0]),
        )
    ]
    notes = {n["path"]: n["note"] for n in suspect_rows(rows)}
    assert set(notes) == {"explicit", "dynamic-asyncio", "bs1-asyncio"}
    assert "round 2 (20.0 tiles/s) more than 3x slower than the median" in notes["explicit"]
    assert "the median stands on the others" in notes["explicit"]
    assert "round 3 (95.0 tiles/s) more than 3x faster" in notes["bs1-asyncio"]
    assert "the median, were slowed by the machine" in notes["bs1-asyncio"]
    assert "above the raw forward pass's 100.0" in notes["dynamic-asyncio"]
    # A model whose smaller batches cost less a tile: the note says what to try (a user trial).
    rows[0]["mean_batch_size"], rows[2]["mean_batch_size"] = 64.0, 25.6
    [note] = [n["note"] for n in suspect_rows(rows) if n["path"] == "dynamic-asyncio"]
    assert "(mean batch 25.6 against raw's 64.0)" in note
    assert "a smaller --max-batch-size serves it faster" in note


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("--tiles=0", "at least 1"),
        ("--rounds=-2", "at least 1"),
        ("--max-batch-size=0", "at least 1"),
        ("--max-wait-ms=nan", "finite number >= 0"),
        ("--max-wait-ms=-1", "finite number >= 0"),
        ("--seed=-1", "seed of at least 0"),
        ("--tiles=many", "whole number"),
    ],
)
def test_cli_refuses_counts_that_would_measure_something_else(
    option: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --tiles -5 sliced the cached bodies with [:-5]; --rounds 0 failed after the warm-up.
    from histoinfer.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", option])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_failing_suite_leaves_the_others_and_a_report(
    workdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from histoinfer.bench import runner
    from histoinfer.cli import main

    def broken(*args: object) -> dict[str, object]:
        raise RuntimeError("a child process died")

    # The suites run in a fixed order (throughput, overhead, latency): the one after the
    # failed one must still run.
    monkeypatch.setattr(runner, "run_overhead", broken)
    calls: list[object] = []

    def latency(*args: object) -> dict[str, object]:
        calls.append(args)
        return {"rows": [], "checks": []}

    monkeypatch.setattr(runner, "run_latency", latency)
    out = tmp_path / "failed"
    argv = ["bench", "--suites=latency,overhead", f"--workdir={workdir}", f"--out={out}", "--quiet"]
    assert main(argv) == 1
    assert calls  # the suite after the failed one ran
    data = json.loads((out / "report.json").read_text())
    assert data["failed"] == [{"suite": "overhead", "error": "RuntimeError: a child process died"}]
    assert (
        "**The overhead suite failed**: RuntimeError: a child process died"
        in (out / "report.md").read_text()
    )
    assert "FAILED: the overhead suite" in capsys.readouterr().err


def test_responses_must_carry_their_own_tiles_numbers() -> None:
    # Rows crossed inside a batch keep their patch_idx (it comes from the request): the
    # numbers are what tell.
    mine, other = [0.5, -0.25], [0.49, -0.2]
    responses = [json.dumps({"patch_idx": i, "output": v}) for i, v in enumerate([mine, other])]
    expected = {0: {"output": mine}, 1: {"output": other}}
    check_responses(responses, "path", expected)
    check_responses(responses[:1], "path", expected)  # fewer responses than references
    nearly = [json.dumps({"patch_idx": 0, "output": [0.5 + 5e-5, -0.25]})]
    check_responses(nearly, "path", expected)  # another batch size's summation order
    crossed = [json.dumps({"patch_idx": i, "output": v}) for i, v in enumerate([other, mine])]
    says = re.escape("response 0's 'output' is not its tile's: 0.05 away")
    with pytest.raises(RuntimeError, match=says):
        check_responses(crossed, "path", expected)
    short = [json.dumps({"patch_idx": 0, "output": [0.5]})]
    with pytest.raises(RuntimeError, match="not its tile's: inf away"):
        check_responses(short, "path", expected)
    with pytest.raises(RuntimeError, match="'embedding' is not its tile's"):
        check_responses(responses[:1], "path", {0: {"output": mine, "embedding": [1.0]}})
    nan = [json.dumps({"patch_idx": 0, "output": [float("nan"), -0.25]})]
    with pytest.raises(RuntimeError, match="not its tile's: nan away"):
        check_responses(nan, "path", expected)
    # A model whose outputs are in the thousands (bench --checkpoint): to its scale.
    large = {0: {"output": [3700.0, -12.5]}}
    summed_otherwise = [json.dumps({"patch_idx": 0, "output": [3700.02, -12.5]})]
    check_responses(summed_otherwise, "path", large)  # 5e-6 of its largest
    with pytest.raises(RuntimeError, match="not its tile's: 1 away"):
        check_responses([json.dumps({"patch_idx": 0, "output": [3701.0, -12.5]})], "path", large)
    # Which bodies are checked: both ends, and a spread between (every batch, every shard).
    assert reference_indices(8) == list(range(8))
    picked = reference_indices(512)
    assert picked[:16] == list(range(16)) and picked[-16:] == list(range(496, 512))
    assert set(range(0, 512, 16)) <= set(picked) and len(picked) == 62


def test_each_round_runs_in_an_order_of_its_own_the_same_in_every_run() -> None:
    from histoinfer.bench.runner import _shuffled

    names = [f"path-{i}" for i in range(12)]
    orders = [_shuffled(names, 0, r, "predict", 512) for r in range(5)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert len({tuple(order) for order in orders}) == 5  # not one order, nor a rotation of it
    assert orders == [_shuffled(names, 0, r, "predict", 512) for r in range(5)]  # seeded
    assert _shuffled(names, 1, 0, "predict", 512) != orders[0]


def test_the_peers_pass_on_the_thread_our_clients_pass_on(tiny_model: ServerModel) -> None:
    # Anywhere else, a second OpenMP team in the process slows every small pass (~3x).
    from histoinfer.bench.peers import forward_thread
    from histoinfer.models.device_thread import device_thread

    executor = forward_thread(tiny_model)
    ran_on = executor.submit(threading.get_ident).result(timeout=30)
    assert ran_on == device_thread(tiny_model.device).ident


def test_the_overhead_suite_says_when_async_batcher_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from histoinfer.bench.runner import run_overhead

    monkeypatch.setitem(sys.modules, "async_batcher", None)  # import fails
    cfg = BenchConfig(rounds=1, overhead_levels=(8,), overhead_requests=200)
    lines: list[str] = []
    result = run_overhead(cfg, lines.append)
    assert result["checks"] == []
    assert {row["variant"] for row in result["rows"]} == {"scheduler-asyncio", "scheduler-trio"}
    [skip] = result["skipped"]
    assert skip["variant"] == "async-batcher" and "not installed" in skip["reason"]
    assert any("skipping async-batcher" in line for line in lines)


@pytest.mark.timeout(90)
def test_a_model_whose_sweep_fails_leaves_the_other_models_results(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from histoinfer.bench import runner

    real = runner._sweep_model

    def sweep(cfg: BenchConfig, size: str, *args: Any) -> Any:
        if size == "small":  # its half-filled sweep is its own, and goes with it
            raise RuntimeError("the small model's child died")
        return real(cfg, size, *args)

    monkeypatch.setattr(runner, "_sweep_model", sweep)
    cfg = BenchConfig(
        models=("tiny", "small"),
        paths=("explicit", "dynamic-asyncio"),
        small_paths=("explicit", "dynamic-asyncio"),
        levels=(4,),
        small_levels=(4,),
        tiles=8,
        min_tiles=8,
        rounds=1,
        suites=("throughput",),
        modes=("predict",),
        workdir=str(workdir),
        isolate=False,
    )
    report = run_bench(cfg, lambda line: None, "test")
    assert report["failed"] == [
        {"suite": "throughput (small model)", "error": "RuntimeError: the small model's child died"}
    ]
    throughput = report["throughput"]
    assert {row["model"] for row in throughput["rows"]} == {"tiny"}
    assert {row["path"] for row in throughput["rows"]} == {"explicit", "dynamic-asyncio"}
    small = [c for c in throughput["checks"] if c["detail"].startswith("small")]
    assert small and all(c["value"] is None for c in small)  # not read from a partial round
    assert "failed" not in run_bench(replace(cfg, models=("tiny",)), lambda line: None, "test")


@pytest.mark.timeout(90)
def test_a_model_whose_lone_latency_fails_leaves_the_other_models_results(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from histoinfer.bench import runner

    real = runner.p50_ms
    measured: list[int] = []

    def p50(latencies: Any) -> float:
        measured.append(1)
        if len(measured) > len(runner.LONE_VARIANTS) + 1:  # the second model, after a reading
            raise RuntimeError("the small model's child died")
        return real(latencies)

    monkeypatch.setattr(runner, "p50_ms", p50)
    # The second model is the tiny one again under another name: the same checkpoint, fast.
    real_checkpoint = runner.ensure_checkpoint
    monkeypatch.setattr(
        runner, "ensure_checkpoint", lambda size, *args: real_checkpoint("tiny", *args)
    )
    cfg = BenchConfig(
        models=("tiny", "small"),
        rounds=1,
        lone_calls=3,
        suites=("latency",),
        workdir=str(workdir),
        isolate=False,
    )
    report = run_bench(cfg, lambda line: None, "test")
    assert report["failed"] == [
        {"suite": "latency (small model)", "error": "RuntimeError: the small model's child died"}
    ]
    latency = report["latency"]
    assert {row["model"] for row in latency["rows"]} == {"tiny"}
    assert {row["variant"] for row in latency["rows"]} == set(runner.LONE_VARIANTS)
    assert latency["checks"] and all(c["detail"].startswith("tiny") for c in latency["checks"])


def test_without_the_plotting_package_the_bench_stops_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It measured for ~50 s, then failed for want of matplotlib (a packaging trial)."""
    import sys

    from histoinfer.bench import runner
    from histoinfer.cli import main

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured without the extra")

    monkeypatch.setattr(runner, "run_bench", measured)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it raises ImportError
    assert main(["bench", "--quick"]) == 1
    assert "'histoinfer bench' needs the 'bench' extra" in capsys.readouterr().err


def test_the_bench_server_leaves_serve_settings_of_the_environment_out() -> None:
    """A container configured through HISTOINFER_* skewed or failed the bench's own server."""
    from histoinfer.bench.loopback import _without_serve_settings

    kept = _without_serve_settings(
        {"PATH": "/bin", "HISTOINFER_MAX_BODY_MB": "0.001", "HISTOINFER_SCRIPT_CACHE": "off"}
    )
    assert kept == {"PATH": "/bin", "HISTOINFER_SCRIPT_CACHE": "off"}
