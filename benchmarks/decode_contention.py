#!/usr/bin/env python
"""Does decoding cost more CPU beside other work? A tile's decode alone, beside a second
decoder, and beside forward passes running on both cores (docs/benchmarks.md).

Dynamic batching spends more CPU a tile on decoding than the explicit loop does; this tells
whether the cores' caches and memory (which the decoders share with the forward pass) are the
reason. Each figure is the decoding thread's own CPU clock over 256 bodies (parse, validate,
base64, PNG, channel-first copy), in ms a tile.

python benchmarks/decode_contention.py [--workdir DIR] [--reps N]
"""

from __future__ import annotations

import threading
import time

import torch

from histoinfer.bench.runner import tiny_script
from histoinfer.models import shards
from histoinfer.models.device_thread import device_thread
from histoinfer.schema import ModelRequest


def main() -> None:
    args, model, bodies = tiny_script(__doc__, 256)

    def decode(part: list[str], out: list[float]) -> None:
        started = time.thread_time()
        for body in part:
            model.prepare_sample(ModelRequest.model_validate_json(body))
        out.append(1000 * (time.thread_time() - started) / len(part))

    def alone() -> float:
        out: list[float] = []
        decode(bodies, out)
        return out[0]

    def two_decoders() -> float:
        out: list[float] = []
        halves = [bodies[::2], bodies[1::2]]
        threads = [threading.Thread(target=decode, args=(half, out)) for half in halves]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(out) / len(out)

    def beside_forward() -> float:
        stop = threading.Event()
        batch = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)

        def passes() -> None:  # sharded over the device's thread and its helper: both cores
            while not stop.is_set():
                shards.forward(model, batch, "predict")

        runner = threading.Thread(target=lambda: device_thread(model.device).call(passes))
        runner.start()
        try:
            time.sleep(0.1)
            return alone()
        finally:
            stop.set()
            runner.join()

    print("decode CPU ms a tile:  alone  beside a 2nd decoder  beside forward passes")
    for _ in range(args.reps):
        print(f"{alone():27.3f} {two_decoders():21.3f} {beside_forward():22.3f}")


if __name__ == "__main__":
    main()
