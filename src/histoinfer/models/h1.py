"""``h1``: the gene-expression tile model, and the builder of its reference checkpoints.

The reference checkpoints carry **seeded, untrained weights**: they exercise the real
architecture, file format and pipeline end to end, but their predictions are not biology. A
user's own trained ``.pt2`` (same input/output contract) plugs in the same way.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from .assets import ASSETS_FILE, ModelAssets
from .base import ServerModel
from .checkpoint import AOTI_INPUT_DTYPE_KEY, quieted
from .genes import REFERENCE_GENE_PANEL
from .registry import register_model
from .vit import VIT_SIZES, GeneViT

__all__ = [
    "REFERENCE_DTYPES",
    "H1ServerModel",
    "ReferenceExport",
    "export_reference_h1",
    "reference_assets",
]

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
REFERENCE_SEED = 20241129
CHECKPOINT_FILE = "model.pt2"
AOTI_CHECKPOINT_FILE = "model-aoti.pt2"
UNTRAINED_NOTE = (
    "Reference checkpoint with seeded, UNTRAINED weights: the real h1 architecture and file "
    "format, for exercising the pipeline. Its predictions are not biologically meaningful."
)


@register_model("h1")
class H1ServerModel(ServerModel):
    """Gene expression from a 224x224 H&E tile at 0.5 µm/px, plus the tile embedding."""


#: The dtypes a reference checkpoint can be exported in (``histoinfer export --dtype``).
REFERENCE_DTYPES = ("float32", "bfloat16", "float16")


def reference_assets(size: str, dtype: str = "float32") -> ModelAssets:
    config = VIT_SIZES[size]
    precision = "" if dtype == "float32" else f"-{dtype}"
    return ModelAssets(
        name="h1",
        version=f"0.1.0-reference-{size}{precision}",
        task="gene-expression",
        tile_size=config.tile_size,
        resolution=0.5,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        interpolation="bilinear",
        gene_names=list(REFERENCE_GENE_PANEL),
        embedding_size=config.dim,
        trained=False,
        description=UNTRAINED_NOTE,
        architecture={
            "family": "vit",
            "size": size,
            "seed": REFERENCE_SEED,
            "dtype": dtype,
            **config.as_dict(),
        },
    )


@dataclass(frozen=True)
class ReferenceExport:
    checkpoint: Path
    assets: Path
    aoti_checkpoint: Path | None
    seconds: float


def build_reference_module(size: str) -> GeneViT:
    if size not in VIT_SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(VIT_SIZES)}")
    module = GeneViT(VIT_SIZES[size], num_genes=len(REFERENCE_GENE_PANEL))
    return module.init_seeded(REFERENCE_SEED).eval()


def export_reference_h1(
    size: str, out_dir: str | Path, *, aoti: bool = False, dtype: str = "float32"
) -> ReferenceExport:
    """Write ``model.pt2`` (torch.export), ``model.json`` and, with ``aoti``, ``model-aoti.pt2``.

    ``dtype`` other than float32 exports the same seeded weights rounded to bfloat16 or
    float16; the program then takes its batch in that dtype (the clients cast it).
    """
    if dtype not in REFERENCE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(REFERENCE_DTYPES)}")
    start = time.perf_counter()
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    module = build_reference_module(size).to(torch_dtype)
    tile = module.config.tile_size
    # An example batch of 2: with a batch of 1, torch.export would freeze the batch size.
    example = torch.zeros(2, 3, tile, tile, dtype=torch_dtype)
    batch = torch.export.Dim("batch", min=1, max=4096)
    with quieted(FutureWarning):
        program = torch.export.export(module, (example,), dynamic_shapes={"x": {0: batch}})
        checkpoint = out / CHECKPOINT_FILE
        with _partial(checkpoint) as partial:
            torch.export.save(program, str(partial))
        aoti_path = None
        if aoti:
            import torch._inductor as inductor

            aoti_path = out / AOTI_CHECKPOINT_FILE
            with _partial(aoti_path) as partial:
                # A package cannot be asked which dtype it takes: it records it (checkpoint.py).
                metadata = {AOTI_INPUT_DTYPE_KEY: dtype}
                inductor.aoti_compile_and_package(
                    program,
                    package_path=str(partial),
                    inductor_configs={"aot_inductor.metadata": metadata},
                )
    assets_path = out / ASSETS_FILE
    with _partial(assets_path) as partial:
        assets = reference_assets(size, dtype).model_dump()
        partial.write_text(json.dumps(assets, indent=2) + "\n", encoding="utf-8")
    return ReferenceExport(checkpoint, assets_path, aoti_path, time.perf_counter() - start)


@contextmanager
def _partial(final: Path) -> Iterator[Path]:
    """A private path to write ``final`` to, renamed over it only once complete.

    A half-written file is never picked up, and two processes exporting into the same folder
    (two first runs of the demo) never write into the same file: the last rename wins, whole.
    The path is ``final``'s own name in a private folder beside it: ``torch.export.save`` names
    the archive's top folder after the file, and a tagged name made every export's bytes, and
    so its sha256, differ.
    """
    _remove_abandoned(final)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder = final.with_name(f"{_partial_prefix(final)}{tag}")
    partial = folder / final.name
    try:
        folder.mkdir()
        yield partial
        partial.replace(final)
    finally:
        partial.unlink(missing_ok=True)
        with suppress(OSError):
            folder.rmdir()


#: a private folder older than this was left by a killed export (an AOTInductor compile of the
#: small model takes minutes, not an hour)
ABANDONED_AFTER_S = 3600.0


def _partial_prefix(final: Path) -> str:
    return f".{final.name}.partial-"


def _remove_abandoned(final: Path) -> None:
    """Delete the private folders of ``final`` that a killed export left behind: an hour old
    (a folder's time is its last new file's: an AOTInductor compile writes nothing for
    minutes), and not its writer's while that process runs here."""
    old = time.time() - ABANDONED_AFTER_S
    prefix = _partial_prefix(final)
    for folder in final.parent.glob(f"{glob.escape(prefix)}*"):
        writer = folder.name.removeprefix(prefix).partition("-")[0]
        with suppress(OSError):
            if folder.is_dir() and folder.stat().st_mtime < old and not _running(writer):
                shutil.rmtree(folder)


def _running(pid: str) -> bool:
    """Whether process ``pid`` runs here (a name that is no pid: as if it did, kept)."""
    if not pid.isdigit():
        return True
    if sys.platform == "win32":
        # os.kill(pid, 0) there terminates the process: as if it ran, the folder is kept.
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True
