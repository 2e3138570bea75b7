"""Loading ``.pt2`` checkpoints: a ``torch.export`` program or an AOTInductor package.

Both kinds are zip archives in the PT2 archive layout; they are told apart by what the archive
holds (compiled AOTInductor artifacts under ``data/aotinductor/`` versus a serialized program
under ``models/``), never by the file name. Every failure is a :class:`CheckpointError` that names
the file, instead of a stack trace from deep inside torch.
"""

from __future__ import annotations

import hashlib
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..errors import InferenceError

__all__ = ["CheckpointError", "CheckpointKind", "LoadedCheckpoint", "load_checkpoint", "sniff_kind"]

CheckpointKind = Literal["torch.export", "aoti"]
Program = Callable[[torch.Tensor], object]


class CheckpointError(InferenceError, ValueError):
    """A checkpoint or its assets could not be loaded. The message names the file."""

    problem_slug = "checkpoint"
    title = "Checkpoint error"


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    kind: CheckpointKind
    sha256: str
    program: Program


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sniff_kind(path: Path) -> CheckpointKind:
    """Which kind of ``.pt2`` this is, from its content."""
    if not path.exists():
        raise CheckpointError(f"checkpoint file not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint path is not a file: {path}")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is not a .pt2 archive (not a readable zip file: {exc})"
        ) from None
    if any("/data/aotinductor/" in n for n in names):
        return "aoti"
    if any("/models/" in n and n.endswith(".json") for n in names):
        return "torch.export"
    raise CheckpointError(
        f"checkpoint {path} is a zip file but neither a torch.export program nor an "
        "AOTInductor package (no models/*.json and no data/aotinductor/ entries)"
    )


def _load_program(path: Path, kind: CheckpointKind, device: str) -> Program:
    with warnings.catch_warnings():
        # torch warns about its own internals (pytree deprecations) on every load.
        warnings.simplefilter("ignore", FutureWarning)
        if kind == "aoti":
            import torch._inductor as inductor

            # An AOTInductor package is compiled for one device type; torch picks it from the
            # package, so a CPU package asked to run on CUDA fails here with a clear message.
            return inductor.aoti_load_package(str(path))  # type: ignore[no-any-return]
        program = torch.export.load(str(path)).module()
        program.to(device)
        return program  # type: ignore[no-any-return]


def load_checkpoint(path: str | Path, device: str = "cpu") -> LoadedCheckpoint:
    """Load a ``.pt2`` file of either kind onto ``device``."""
    path = Path(path).expanduser()
    kind = sniff_kind(path)
    try:
        program = _load_program(path, kind, device)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(
            f"checkpoint {path} ({kind}) could not be loaded on device {device!r}: {first_line}"
        ) from exc
    return LoadedCheckpoint(path=path, kind=kind, sha256=file_sha256(path), program=program)
