"""Helpers for the server tests: real servers on loopback, and test models.

- :func:`serve`: ``histoinfer serve`` in a subprocess on a free port, waited for on
  ``/health/ready`` with a deadline, always stopped on exit (the bench's ``ServerProcess``).
- :class:`ThreadServer`: uvicorn in a thread of the test process (no second torch import).
- ``SlowModel`` / ``FlakyModel``: the tiny h1 with a slow decode for ``slide_name="slow-S"``
  (sleeps S seconds) and a forward pass that fails on an all-white tile.

Run as a script, this file is ``histoinfer`` with the test models registered (``h1-slow``,
``h1-flaky``): ``python tests/test_server_support.py serve --model slow=h1-slow ...``.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from histoinfer.bench.loopback import ServerProcess, free_port, wait_ready
from histoinfer.models import register_model
from histoinfer.models.h1 import H1ServerModel
from histoinfer.schema import Mode, ModelRequest

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"


class SlowModel(H1ServerModel):
    """Decoding a tile whose slide is ``slow-S`` takes S more seconds (an in-flight request)."""

    def prepare_sample(self, request: ModelRequest, where: str | None = None) -> torch.Tensor:
        if request.slide_name.startswith("slow-"):
            time.sleep(float(request.slide_name.removeprefix("slow-")))
        return super().prepare_sample(request, where)


class FlakyModel(H1ServerModel):
    """The forward pass raises for any batch holding an all-white tile."""

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> Any:
        if bool((batch == 255).flatten(1).all(dim=1).any()):
            raise RuntimeError("white tile: the test model refuses it")
        return super().forward_batch(batch, mode)


def register_test_models() -> None:
    register_model("h1-slow")(SlowModel)
    register_model("h1-flaky")(FlakyModel)


def white_body(i: int = 0, size: int = 224) -> str:
    """A valid request whose tile is all white (FlakyModel fails on it)."""
    import json

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (255, 255, 255)).save(buffer, format="PNG")
    return json.dumps(
        {
            "image_data": base64.b64encode(buffer.getvalue()).decode(),
            "slide_name": "white",
            "x": 0,
            "y": 0,
            "width": size,
            "height": size,
            "patch_idx": i,
        }
    )


def serve(args: Sequence[str], *, script: bool = False, ready_s: float = 90.0) -> ServerProcess:
    """``histoinfer serve ARGS`` (``script``: this file, with the test models) on a free port."""
    launcher = [str(HERE)] if script else ["-m", "histoinfer"]
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), str(HERE.parent)])}
    return ServerProcess(args, launcher=launcher, env=env, ready_timeout=ready_s)


class ThreadServer:
    """uvicorn serving ``app`` on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any, ready_s: float = 60.0, **options: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, lifespan="on", log_level="warning", **options
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.thread.start()
        try:
            wait_ready(self.base_url, ready_s, alive=self.thread.is_alive)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def thread_server(app: Any) -> Iterator[ThreadServer]:
    server = ThreadServer(app)
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    import signal

    # Started from a background job (`cmd &` without job control), a process inherits SIGINT
    # ignored, and uvicorn then restores "ignored" and re-raises into nothing: exit 0, not
    # 130. The tests send SIGINT as a terminal would: take it as a foreground process does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    register_test_models()
    from histoinfer.cli import main

    raise SystemExit(main())


def test_the_serve_cli_freezes_the_start_up_heap() -> None:
    import gc

    from histoinfer.server.cli import freeze_startup_heap

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0  # at least this test session's modules
    finally:
        gc.unfreeze()
