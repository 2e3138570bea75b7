#!/usr/bin/env python
"""What a CPU forward pass of the tiny model costs under the conditions the pipeline gives it
(docs/benchmarks-history.md, "Session 12").

Two questions behind two unmet targets:

* **idle**: a pass of one tile after the cores were idle for a while (a lone request's pass
  starts ~3.3 ms after the last one: the caller's pause, the hop, the decode), against one
  straight after another and one 2 ms after (the lone bound's raw forward(1)); on torch's
  threads and on one thread, and with the OpenMP team woken partway through the pause.
* **threads**: a batch of 48 decoded tiles on one thread (whole, or in parts), sharded across
  two single-threaded workers as the clients run it, and on one thread (in parts of 16) beside
  a thread that decodes bodies non-stop. If one thread were cheaper a tile than the sharded
  pass, a pipeline with the pass on one core and the decoders on the other would beat the
  dynamic / explicit ceiling of docs/benchmarks.md; it is not.

Every pass runs on the device's forward thread, where the clients run theirs (one OpenMP team
in the process). Medians, ms a tile.

python benchmarks/forward_conditions.py [--workdir DIR] [--reps N]
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch

from histoinfer.bench.runner import tiny_script
from histoinfer.models import shards
from histoinfer.models.device_thread import device_thread
from histoinfer.models.openmp import thread_count
from histoinfer.schema import ModelRequest

PAUSES: dict[str, tuple[float, float]] = {
    # name: (pause before the pass, s; when to wake the OpenMP team during it, s or 0)
    "back to back": (0.0, 0.0),
    "after 2 ms": (0.002, 0.0),
    "after 3.3 ms": (0.0033, 0.0),
    "after 3.3 ms, team woken at 2": (0.0033, 0.002),
}


def main() -> None:
    args, model, bodies = tiny_script(__doc__, 128)
    device = device_thread(model.device)

    def prepare(body: str) -> torch.Tensor:
        return model.prepare_sample(ModelRequest.model_validate_json(body))

    tiles = [prepare(body) for body in bodies[:48]]
    # Made on the device's thread: a tensor op on this thread would start a second OpenMP team
    # and put the process in libgomp's throttled regime (docs/benchmarks-history.md, Session 4).
    wake = device.call(torch.ones, 1 << 20)

    def after_pause(pause: float, wake_at: float, threads: int | None) -> float:
        took = []
        with thread_count(threads):
            for i in range(150):
                if wake_at:
                    time.sleep(wake_at)
                    wake.add_(1)  # a parallel op: the team's workers wake up
                    time.sleep(pause - wake_at)
                elif pause:
                    time.sleep(pause)
                started = time.perf_counter()
                model.forward_tiles([tiles[i % 8]], "predict")
                took.append(time.perf_counter() - started)
        return statistics.median(took) * 1e3

    def timed(run: Callable[[], object], tiles_per_run: int, runs: int = 6) -> float:
        took = []
        for _ in range(runs):
            started = time.perf_counter()
            run()
            took.append(time.perf_counter() - started)
        return statistics.median(took) / tiles_per_run * 1e3

    def one_thread(part: int) -> float:
        def run() -> None:
            for start in range(0, len(tiles), part):
                model.forward_tiles(tiles[start : start + part], "predict")

        with thread_count(1):
            return timed(run, len(tiles))

    def beside_a_decoder() -> tuple[float, float]:
        stop, decoded = threading.Event(), [0]

        def decoder() -> None:
            while not stop.is_set():
                prepare(bodies[decoded[0] % len(bodies)])
                decoded[0] += 1

        thread = threading.Thread(target=decoder)
        thread.start()
        time.sleep(0.05)
        started, before = time.perf_counter(), decoded[0]
        forward = device.call(one_thread, 16)
        per_decode = (time.perf_counter() - started) / max(1, decoded[0] - before) * 1e3
        stop.set()
        thread.join()
        return forward, per_decode

    for rep in range(args.reps):
        print(f"-- repetition {rep + 1}")
        for threads, label in ((None, "torch's threads"), (1, "one thread")):
            cells = [
                f"{name} {device.call(after_pause, pause, wake_at, threads):.2f}"
                for name, (pause, wake_at) in PAUSES.items()
                if threads is None or not wake_at
            ]
            print(f"  a pass of 1 tile, {label}: " + ", ".join(cells))
        parts = ", ".join(f"parts of {p} {device.call(one_thread, p):.2f}" for p in (8, 16, 48))
        sharded = device.call(lambda: timed(lambda: shards.forward(model, tiles, "predict"), 48))
        forward, per_decode = beside_a_decoder()
        decode_alone = timed(lambda: [prepare(b) for b in bodies[:64]], 64, runs=3)
        print(f"  48 tiles on one thread: {parts}")
        print(f"  48 tiles sharded on 2 workers: {sharded:.2f} wall, {2 * sharded:.2f} CPU")
        print(
            f"  48 tiles on one thread in parts of 16 beside a decoder: {forward:.2f} "
            f"(the decoder {per_decode:.2f} a body; alone {decode_alone:.2f})"
        )


if __name__ == "__main__":
    main()
