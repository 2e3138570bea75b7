"""Sharded CPU forward passes: one batch run as parts on single-threaded workers."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from concurrency_helpers import body, hooked_model

from histoinfer import InProcessClient, ServerModel
from histoinfer.models import shards
from histoinfer.models.device_thread import device_thread, helper_threads
from histoinfer.models.openmp import per_thread_counts_supported

T = TypeVar("T")

needs_per_thread_counts = pytest.mark.skipif(
    not per_thread_counts_supported(),
    reason="torch's OpenMP runtime here is not libgomp: passes are never sharded",
)


def on_device(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the device's thread; a hang fails the test within a minute."""
    return device_thread("cpu").submit(fn, *args).result(timeout=60)


def tiles(n: int, size: int = 224, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)


@needs_per_thread_counts
@pytest.mark.parametrize(
    ("tiles_", "threads", "expected"),
    [
        (51, 2, (2, 13)),  # two workers, two parts each
        (64, 2, (2, 16)),
        (16, 2, (2, 8)),
        (17, 2, (2, 9)),  # 9 + 8, not 8 + 8 + 1
        (31, 2, (2, 11)),  # three parts of MIN_PART_TILES or more
        (15, 2, (2, 8)),  # a small batch: one part per worker
        (3, 2, (2, 2)),  # 2 + 1
        (2, 2, (2, 1)),  # the smallest sharded pass
        (1, 2, (1, 1)),  # a lone request: torch's threads, every core
        (64, 4, (4, 8)),
        (20, 4, (4, 5)),  # a part for every thread
        (5, 4, (3, 2)),  # 2 + 2 + 1: a worker is left without a part
        (3, 4, (3, 1)),
        (64, 1, (1, 64)),  # one torch thread: nothing to share
        (64, shards.MAX_WORKERS + 1, (1, 64)),  # not measured on bigger boxes
    ],
)
def test_plan(
    tiny_model: ServerModel, tiles_: int, threads: int, expected: tuple[int, int]
) -> None:
    assert shards.plan(tiny_model, tiles_, threads) == expected


@needs_per_thread_counts
def test_every_plan_covers_its_tiles_in_parts_none_empty(tiny_model: ServerModel) -> None:
    for threads in range(1, 9):
        for n in range(1, 513):
            workers, size = shards.plan(tiny_model, n, threads)
            if workers == 1:  # not sharded: the whole batch on torch's threads
                assert size == n
                assert n == 1 or not 2 <= threads <= shards.MAX_WORKERS
                continue
            parts = -(-n // size)
            assert 2 <= workers <= min(threads, parts)
            assert (parts - 1) * size < n <= parts * size  # the last part is not empty


@needs_per_thread_counts
@pytest.mark.parametrize("as_list", [False, True])
def test_a_small_sharded_pass_answers_every_tile_in_order(
    tiny_model: ServerModel, as_list: bool
) -> None:
    batch = tiles(3, seed=3)
    sizes: list[int] = []
    model, _ = hooked_model(tiny_model, lambda part: sizes.append(int(part.shape[0])), sharded=True)
    out = on_device(shards.forward, model, list(batch) if as_list else batch, "predict", 2)
    whole = tiny_model.forward_batch(batch, "predict")
    assert out.predictions is not None and whole.predictions is not None
    torch.testing.assert_close(out.predictions, whole.predictions)
    assert sorted(sizes) == [1, 2]  # 2 + 1, on two workers


def test_accelerators_are_never_sharded(tiny_model: ServerModel) -> None:
    on_gpu = copy.copy(tiny_model)
    on_gpu.device = torch.device("cuda")
    assert shards.plan(on_gpu, 64, 2) == (1, 64)
    assert not shards.available(on_gpu, 2)


def test_models_that_opt_out_or_are_aoti_packages_are_never_sharded(
    tiny_model: ServerModel,
) -> None:
    class NotThreadSafe(ServerModel):
        shard_cpu_passes = False

    opted_out = NotThreadSafe(tiny_model.checkpoint, tiny_model.assets)
    aoti = copy.copy(tiny_model)
    aoti.checkpoint = dataclasses.replace(tiny_model.checkpoint, kind="aoti")
    for model in (opted_out, aoti):
        assert not model.shardable
        assert shards.plan(model, 64, 2) == (1, 64)
        watched, watch = hooked_model(model, sharded=True)  # its own opt-out only
        on_device(shards.forward, watched, tiles(32), "predict", 2)
        assert watch.sizes == [32]  # one call, the whole batch
    assert tiny_model.shardable


@needs_per_thread_counts
@pytest.mark.parametrize("as_list", [False, True])
def test_a_sharded_pass_gives_every_tile_its_own_output_in_order(
    tiny_model: ServerModel, as_list: bool
) -> None:
    batch = tiles(37)
    calls: list[tuple[int, int, int]] = []
    model, _ = hooked_model(
        tiny_model,
        lambda part: calls.append(
            (int(part.shape[0]), threading.get_ident(), torch.get_num_threads())
        ),
        sharded=True,
    )
    worker = device_thread("cpu")
    given = list(batch) if as_list else batch
    out = on_device(shards.forward, model, given, "predict_with_embedding", 2)
    # Each tile alone: the same model, one tile per pass, no sharding.
    alone = [tiny_model.forward_batch(batch[i : i + 1], "predict_with_embedding") for i in (0, 36)]
    assert out.predictions is not None and out.embedding is not None
    assert out.predictions.shape[0] == out.embedding.shape[0] == 37
    for row, single in zip((0, 36), alone, strict=True):
        assert single.predictions is not None and single.embedding is not None
        torch.testing.assert_close(out.predictions[row], single.predictions[0])
        torch.testing.assert_close(out.embedding[row], single.embedding[0])
    whole = tiny_model.forward_batch(batch, "predict_with_embedding")
    assert whole.predictions is not None
    torch.testing.assert_close(out.predictions, whole.predictions)
    assert sorted(size for size, _, _ in calls) == [7, 10, 10, 10]  # 2 workers x 2 parts
    assert {threads for _, _, threads in calls} == {1}  # each part single-threaded
    helper = helper_threads("cpu", 1)[0]
    assert {ident for _, ident, _ in calls} <= {worker.ident, helper.ident}
    assert on_device(torch.get_num_threads) == torch.get_num_threads()  # restored


@needs_per_thread_counts
def test_a_failing_part_fails_the_pass_only_after_every_worker_stopped(
    tiny_model: ServerModel,
) -> None:
    running = 0
    most_after_failure: list[int] = []
    guard = threading.Lock()
    failed = threading.Event()

    def before(part: torch.Tensor) -> None:
        nonlocal running
        with guard:
            running += 1
        try:
            if int(part[0, 0, 0, 0]) == 255:  # the marked part
                failed.set()
                raise RuntimeError("bad part")
            # The first part is short, so its worker takes the third (the failing one) while
            # the other worker is still busy with the second: the fourth is left to nobody.
            time.sleep(0.05 if int(part[0, 0, 0, 0]) == 0 else 0.4)
        finally:
            with guard:
                running -= 1

    batch = tiles(64)
    batch[:, 0, 0, 0] = 0
    batch[16, 0, 0, 0] = 100  # first tile of the second part (parts of 16): a long one
    batch[32, 0, 0, 0] = 255  # first tile of the third part
    model, watch = hooked_model(tiny_model, before, sharded=True)

    def run() -> None:
        try:
            shards.forward(model, batch, "predict", 2)
        finally:
            most_after_failure.append(running)

    with pytest.raises(RuntimeError, match="bad part"):
        on_device(run)
    assert failed.is_set()
    assert most_after_failure == [0]  # nothing of the pass still runs once it has raised
    assert watch.calls < 4  # the fourth part was never started


@needs_per_thread_counts
def test_a_sharded_pass_returns_only_once_every_part_is_done(tiny_model: ServerModel) -> None:
    """SPEC §5: one forward pass at a time per device. The device's thread runs the next pass
    only once this one returns, so no part of it may still be running then."""
    running = 0
    most = 0
    guard = threading.Lock()
    at_return: list[int] = []
    model, watch = hooked_model(tiny_model, sharded=True)
    original = model.forward_batch

    def forward_batch(part: torch.Tensor, mode: str) -> object:
        nonlocal running, most
        with guard:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.02 if threading.get_ident() != device_thread("cpu").ident else 0)
            return original(part, mode)  # type: ignore[arg-type]
        finally:
            with guard:
                running -= 1

    model.forward_batch = forward_batch  # type: ignore[assignment]

    def run() -> None:
        shards.forward(model, tiles(64), "predict", 2)
        at_return.append(running)

    for _ in range(3):
        on_device(run)
    assert at_return == [0, 0, 0]
    assert most <= 2 and watch.calls == 12  # two workers, four parts a pass


@needs_per_thread_counts
def test_the_explicit_loop_and_dynamic_batching_agree_with_sharding(
    tiny_model: ServerModel,
) -> None:
    bodies = [body(i) for i in range(40)]
    with InProcessClient(tiny_model, max_batch_size=40, dynamic_batching=False) as client:
        sharded = client.predict_batch(bodies)  # one pass of 40: sharded
    with InProcessClient(tiny_model, max_batch_size=1, dynamic_batching=False) as client:
        alone = client.predict_batch(bodies)  # 40 passes of 1: never sharded
    for got, expected in zip(sharded, alone, strict=True):
        a, b = json.loads(got), json.loads(expected)
        assert (a["x"], a["y"]) == (b["x"], b["y"])
        torch.testing.assert_close(torch.tensor(a["output"]), torch.tensor(b["output"]))


def test_default_decode_threads_use_every_core_where_passes_are_sharded(
    tiny_model: ServerModel,
) -> None:
    with InProcessClient(tiny_model) as client:
        threads = torch.get_num_threads()
        if shards.available(tiny_model, threads):
            assert client.prepare_threads == (os.cpu_count() or 2)
        else:
            assert client.prepare_threads == max(1, (os.cpu_count() or 2) - threads)


_TEAM_CHECK = """
import os, sys, torch
from histoinfer.models import build_server_model, shards
from histoinfer.models.device_thread import device_thread, helper_threads

def tasks():
    return {int(task) for task in os.listdir("/proc/self/task")}

model = build_server_model("h1", sys.argv[1])
worker = device_thread("cpu")
worker.call(model.forward_batch, torch.zeros(1, 3, 224, 224, dtype=torch.uint8), "predict")
batch = torch.zeros(32, 3, 224, 224, dtype=torch.uint8)
before = tasks()
for _ in range(3):
    worker.call(shards.forward, model, batch, "predict", 2)
print(sorted(tasks() - before), helper_threads("cpu", 1)[0]._thread.native_id)
"""


@needs_per_thread_counts
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_parts_run_on_no_openmp_team_of_their_own(tiny_checkpoint: Path) -> None:
    """A helper that ran a parallel op would get a team, and the process more OpenMP threads
    than cores: libgomp's slow regime (models/device_thread.py). In a fresh process (this one
    has run anything), only the helper itself may appear."""
    result = subprocess.run(
        [sys.executable, "-c", _TEAM_CHECK, str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    new, helper = result.stdout.strip().rsplit(" ", 1)
    assert new == f"[{helper}]", result.stdout


def test_describe_says_how_passes_run_here() -> None:
    if per_thread_counts_supported():
        assert shards.describe(2).startswith("batches of 2+ tiles sharded across up to 2")
        assert "not sharded: 8 threads" in shards.describe(shards.MAX_WORKERS * 2)
    assert shards.describe(1) == "on torch's threads (not sharded: 1 thread)"
