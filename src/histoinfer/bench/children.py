"""What runs inside a bench child process: the paths and lone-latency variants, built there.

Each path is measured in a process of its own (``isolation`` says why). The runner names these
factories by module and name (``FACTORY``), so that the orchestrating process never imports
torch; the child imports this module, builds its object and answers ``measure`` calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..models import ServerModel, build_server_model, png, shards
from ..models.device_thread import device_thread
from ..schema import Mode, parse_request
from .isolation import Unavailable
from .latency import LoneLatency
from .measure import Expected, Sample, cpu_split, thread_cpu_clocks
from .own import REFERENCE_BUILD, ModelBuild, import_user_modules
from .paths import PATHS, BenchContext, BenchPath, make_paths
from .peers import Pipeline
from .runner import PathSpec, load_bodies

__all__ = ["OpenPath", "open_lone", "open_path", "prepare_tiles", "torch_environment"]


def torch_environment() -> dict[str, Any]:
    """What the report says about torch and the decoders, as a child process sees them."""
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_passes": shards.describe(torch.get_num_threads()),
        "png_decoders": [decoder.name for decoder in png.DECODERS] + ["Pillow"],
        "cuda": torch.cuda.is_available(),
    }


def prepare_tiles(model: ServerModel, bodies: Sequence[str]) -> list[torch.Tensor]:
    return [model.prepare_sample(parse_request(b)) for b in bodies]


class OpenPath:
    """One opened path over the first ``n`` of its bodies; CPU time is counted where it runs."""

    def __init__(self, path: BenchPath, bodies: list[str]) -> None:
        self.path = path
        self.bodies = bodies
        model = path.ctx.model
        self.info = {
            "label": path.label,
            "note": path.note,
            "environment": torch_environment(),
            # how its program ran (TorchScript's interpreter or an fx module: models/scripted.py)
            "program_runner": _runs_as(model) if model is not None else None,
            "has_model": model is not None,
        }

    def reference(self, indices: Sequence[int], mode: Mode) -> dict[int, Expected]:
        """The response numbers of the bodies at ``indices``, each tile run alone on the
        device's thread: what every path's responses must hold (``measure.check_responses``)."""
        model = self.path.ctx.server_model
        pipeline = Pipeline(model, mode)  # the request's steps, as plain functions
        expected = {}
        for i in indices:
            request, tile = pipeline.prepare(self.bodies[i])
            [output] = device_thread(model.device).call(model.forward_tiles, [tile], mode).split()
            response = json.loads(pipeline.finish(request, output))
            expected[i] = {k: response[k] for k in ("output", "embedding") if k in response}
        return expected

    def expect(self, expected: dict[str, dict[int, Expected]]) -> None:
        """From now on, check responses against ``expected`` (by mode; see ``reference``)."""
        self.path.ctx.expected.update(expected)

    def measure(self, n: int, concurrency: int, mode: Mode = "predict") -> Sample:
        self.path.get_ready(self.bodies[:n], concurrency, mode)
        server0, threads0 = self.path.external_cpu_s(), thread_cpu_clocks()
        process0 = time.process_time()
        sample = self.path.measure(self.bodies[:n], concurrency, mode)
        process_s = time.process_time() - process0
        threads, server1 = thread_cpu_clocks(), self.path.external_cpu_s()
        # A server's CPU that cannot be read (no /proc) leaves the total unknown, not short.
        server_s = None if server0 is None or server1 is None else server1 - server0
        server = server_s if self.path.external else None
        split = cpu_split(threads0, threads, process_s, server, self.path.loop_thread)
        sample = self.path.finish(sample)  # outside the clocks
        cpu_s = None if server_s is None else process_s + server_s
        return replace(sample, cpu_s=cpu_s, cpu_split_s=split)

    def close(self) -> None:
        self.path.close()


def open_path(spec: PathSpec) -> OpenPath:
    """Build the model, bodies and path of ``spec`` (in the process that will measure it)."""
    needs_model = spec.name not in PATHS or PATHS[spec.name].needs_model
    model = _built(spec.build, spec.checkpoint) if needs_model else None
    bodies = load_bodies(spec.bodies, spec.seed, Path(spec.workdir), _silent, spec.build.tile_size)
    ctx = BenchContext(
        spec.size,
        model,
        Path(spec.checkpoint),
        spec.max_batch_size,
        spec.max_wait_ms,
        [],
        build=spec.build,
    )
    [path] = make_paths([spec.name], ctx)
    if path.needs_tiles:
        ctx.tiles.extend(prepare_tiles(ctx.server_model, bodies))
    reason = path.unavailable()
    if reason is not None:
        raise Unavailable(reason)
    try:
        path.open()
    except Exception as exc:
        raise Unavailable(f"could not start: {exc}") from exc
    return OpenPath(path, bodies)


def open_lone(
    checkpoint: str,
    bodies: int,
    seed: int,
    workdir: str,
    build: ModelBuild = REFERENCE_BUILD,
) -> LoneLatency:
    """The lone-latency measurer, built in the process that will measure one variant."""
    model = _built(build, checkpoint)
    loaded = load_bodies(bodies, seed, Path(workdir), _silent, build.tile_size)
    lone = LoneLatency(model, loaded, prepare_tiles(model, loaded))
    lone.info.update(environment=torch_environment(), program_runner=_runs_as(model))
    return lone


def _built(build: ModelBuild, checkpoint: str) -> ServerModel:
    """``checkpoint``'s model as ``build`` says, in this process: a model of the user's own
    after the modules that register it."""
    import_user_modules(build.imports)
    return build_server_model(build.key, checkpoint, assets_dir=build.assets)


def _runs_as(model: ServerModel) -> str:
    """How ``model``'s passes run, for the report: its program (models/scripted.py) and the
    layout of its CPU batches."""
    return f"{model.runner}, {model.batch_layout} batches"


def _silent(message: str) -> None:
    pass
