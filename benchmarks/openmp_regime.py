#!/usr/bin/env python
"""How a second thread's OpenMP team slows torch on the CPU (docs/benchmarks-history.md, session 3).

Times a forward pass of one tile on the device's forward thread (where the clients run every
forward pass, models/device_thread.py) and the explicit ``predict_batch`` loop over 512 tiles:
with only that thread's team in the process, with a second thread alive that has run one
forward pass (its team with it), and again once that thread has exited.

python benchmarks/openmp_regime.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

from histoinfer import InProcessClient, build_server_model
from histoinfer.bench.runner import default_workdir, ensure_checkpoint, load_bodies
from histoinfer.models.device_thread import device_thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=default_workdir())
    args = parser.parse_args()
    checkpoint = ensure_checkpoint("tiny", args.workdir, print)
    bodies = load_bodies(512, 0, args.workdir, print)
    model = build_server_model("h1", checkpoint)
    client = InProcessClient(model, dynamic_batching=False)
    one = torch.zeros(1, 3, 224, 224, dtype=torch.uint8)

    def forward_one() -> list[float]:
        forward = []
        for _ in range(60):
            t0 = time.perf_counter()
            model.forward_batch(one, "predict")
            forward.append(time.perf_counter() - t0)
            time.sleep(0.002)
        return forward

    def measure(label: str) -> None:
        forward = device_thread(model.device).call(forward_one)
        loop = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(0, 512, 64):
                client.predict_batch(bodies[i : i + 64])
            loop.append(512 / (time.perf_counter() - t0))
        print(
            f"{label:<38} forward(1) p50 {statistics.median(forward[10:]) * 1e3:5.2f} ms   "
            f"explicit loop {statistics.median(loop):5.0f} tiles/s"
        )

    client.predict_batch(bodies[:64])  # warm-up
    measure("the device thread's team only")
    release = threading.Event()

    def second() -> None:
        model.forward_batch(one, "predict")
        release.wait()

    parked = threading.Thread(target=second)
    parked.start()
    time.sleep(0.3)
    measure("+ a second thread's team (alive)")
    release.set()
    parked.join()
    time.sleep(0.3)
    measure("the second thread exited")
    client.close()


if __name__ == "__main__":
    main()
