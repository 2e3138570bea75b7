"""``histoinfer demo``: the main job on a built-in default, with no arguments.

Builds (once, cached) the ``small`` reference checkpoint, cuts tiles from a real tissue image
that ships inside scikit-image (``data.immunohistochemistry()``, 512x512 IHC, no known copyright
restrictions), runs ``predict_with_embedding`` over every tile through the dynamic-batching
client, and writes an NPZ. The reference weights are seeded and UNTRAINED: the demo shows the
pipeline, not biology.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from PIL import Image

from .clients.inprocess import InProcessClient
from .extras import install_hint
from .models.h1 import CHECKPOINT_FILE, export_reference_h1, reference_assets

__all__ = ["cache_dir", "demo_image", "run_demo", "tile_requests"]


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("histoinfer"))


def reference_checkpoint(size: str) -> tuple[Path, bool]:
    """The cached reference checkpoint for ``size``, built on first use. Returns (path, built)."""
    version = reference_assets(size).version
    folder = cache_dir() / f"h1-{version}"
    checkpoint = folder / CHECKPOINT_FILE
    if checkpoint.is_file() and (folder / "model.json").is_file():
        return checkpoint, False
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a container's read-only home
        raise OSError(
            f"cannot build the reference checkpoint in {folder} ({exc.strerror}): set "
            "XDG_CACHE_HOME to a writable folder (the cache is $XDG_CACHE_HOME/histoinfer), or "
            "build one with `histoinfer export h1 --size SIZE --out DIR` into $XDG_CACHE_HOME/"
            f"histoinfer/h1-{version} beforehand"
        ) from None
    print(f"building the h1 '{size}' reference checkpoint in {folder} (once) ...", flush=True)
    print("  note: seeded, UNTRAINED weights: real architecture and format, not a trained model")
    export_reference_h1(size, folder)
    return checkpoint, True


def demo_image() -> tuple[np.ndarray, str]:
    """The skimage IHC image, or a generated tissue-like image if scikit-image is missing."""
    try:
        from skimage import data

        ihc = data.immunohistochemistry()  # type: ignore[no-untyped-call]
        return np.asarray(ihc, dtype=np.uint8), "skimage IHC (512x512)"
    except Exception as exc:  # ImportError, or a data file missing from the install
        print(
            f"note: scikit-image's immunohistochemistry image is unavailable ({exc}); "
            "using a generated image instead (the 'demo' extra has the real one: "
            f"{install_hint('demo')})",
            file=sys.stderr,
        )
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:512, 0:512]
    blobs = np.sin(xx / 23.0) * np.cos(yy / 17.0) + rng.normal(0, 0.3, (512, 512))
    pink = np.stack([230 - 40 * blobs, 160 - 60 * blobs, 200 - 30 * blobs], axis=-1)
    return np.clip(pink, 0, 255).astype(np.uint8), "generated (512x512)"


def tile_requests(image: np.ndarray, tile: int, stride: int, slide: str) -> list[str]:
    """Cut a grid of tiles and encode each as a ModelRequest JSON body (base64 PNG)."""
    height, width = image.shape[:2]
    if tile > min(height, width):
        raise ValueError(f"--tile {tile} is larger than the image ({width}x{height})")
    if tile <= 0:
        raise ValueError(f"--tile must be positive, got {tile}")
    if stride <= 0:
        raise ValueError(f"--stride must be positive, got {stride}")
    bodies: list[str] = []
    for y in range(0, height - tile + 1, stride):
        for x in range(0, width - tile + 1, stride):
            buf = io.BytesIO()
            Image.fromarray(image[y : y + tile, x : x + tile]).save(buf, format="PNG")
            body = {
                "image_data": base64.b64encode(buf.getvalue()).decode("ascii"),
                "slide_name": slide,
                "x": x,
                "y": y,
                "width": tile,
                "height": tile,
                "patch_idx": len(bodies),
            }
            bodies.append(json.dumps(body))
    return bodies


class _Progress:
    """tqdm when available and wanted; otherwise silent."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="tile", desc="predict_with_embedding")
            except ImportError:
                pass

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _run_all(client: InProcessClient, bodies: list[str], progress: _Progress) -> list[str]:
    responses: list[str] = [""] * len(bodies)

    async def one(i: int) -> None:
        responses[i] = await client.predict_with_embedding_async(bodies[i])
        progress.update()

    # All tiles in flight at once: the dynamic batcher forms the device batches.
    async with anyio.create_task_group() as tg:
        for i in range(len(bodies)):
            tg.start_soon(one, i)
    return responses


#: the file ``--out`` names when it is a folder (the CLI's default name)
DEFAULT_NPZ = "histoinfer-demo.npz"


def _npz_path(given: str | Path) -> Path:
    """Where the results go, checked before the run: a folder (one that exists, or a name
    ending in ``/``) gets :data:`DEFAULT_NPZ` inside it; numpy adds ``.npz`` to a name without
    it (so the path said is the one written); and a folder that cannot be made or written to,
    or a file that cannot be replaced, fails now, named as ``--out``, not after every tile is
    computed."""
    out = Path(given).expanduser()
    folder = str(given).endswith(("/", os.sep))
    if (folder or out.is_dir()) and out.suffix != ".npz":
        out = out / DEFAULT_NPZ
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"--out {out}: cannot create its folder ({exc})") from exc
    if out.is_dir():
        raise OSError(f"--out {out} is a folder: name the .npz file to write")
    try:  # a file of our own beside it, gone at once: its folder takes new files
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as exc:
        raise OSError(f"--out {out}: its folder cannot be written to ({exc})") from exc
    if out.exists() and not os.access(out, os.W_OK):
        raise OSError(f"--out {out} exists and cannot be written to")
    return out


def run_demo(
    *,
    out: str | Path,
    size: str = "small",
    device: str = "cpu",
    backend: str = "asyncio",
    tile: int = 112,
    stride: int = 56,
    progress: bool = True,
) -> int:
    started = time.perf_counter()
    out = _npz_path(out)
    checkpoint, _ = reference_checkpoint(size)
    image, source = demo_image()
    bodies = tile_requests(image, tile, stride, slide="skimage-ihc")
    print(f"image: {source}; {len(bodies)} tiles of {tile}px (stride {stride})")

    with InProcessClient.from_checkpoint("h1", checkpoint, device=device) as client:
        meta = json.loads(client.metadata())
        bar = _Progress(len(bodies), progress and sys.stderr.isatty())
        t0 = time.perf_counter()
        try:
            responses = anyio.run(_run_all, client, bodies, bar, backend=backend)
        finally:
            bar.close()
        elapsed = time.perf_counter() - t0
        stats = client.stats()["predict_with_embedding"]

    parsed = [json.loads(r) for r in responses]
    outputs = np.asarray([p["output"] for p in parsed], dtype=np.float32)
    embeddings = np.asarray([p["embedding"] for p in parsed], dtype=np.float32)
    genes = np.asarray(meta["gene_names"])
    np.savez_compressed(
        out,
        output=outputs,
        embedding=embeddings,
        x=np.asarray([p["x"] for p in parsed]),
        y=np.asarray([p["y"] for p in parsed]),
        patch_idx=np.asarray([p["patch_idx"] for p in parsed]),
        gene_names=genes,
        # What made these numbers, in the file: the reference weights are untrained.
        model_version=np.asarray(meta["version"]),
        trained=np.asarray(meta["trained"]),
        checkpoint_sha256=np.asarray(meta["checkpoint_sha256"]),
    )
    top = np.argsort(-outputs.mean(axis=0))[:5]
    print(
        f"done: {len(bodies)} tiles in {elapsed:.2f} s ({len(bodies) / elapsed:.1f} tiles/s, "
        f"{stats.batches} batches, mean batch size {stats.mean_batch_size:.1f}) on {device}, "
        f"{backend}"
    )
    print(f"model: h1 {meta['version']}, {len(genes)} genes, embedding {meta['embedding_size']}")
    print(
        "top genes by mean prediction: "
        + ", ".join(f"{genes[i]} ({outputs[:, i].mean():.3f})" for i in top)
    )
    print("(reference weights are seeded and UNTRAINED: these values are not biology)")
    print(
        f"wrote {out} (output, embedding, x, y, patch_idx, gene_names, model_version, "
        "trained, checkpoint_sha256)"
    )
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0
