"""Request bodies for benchmarks: seeded, H&E-like 224x224 RGB tiles as base64-PNG JSON strings.

Random-noise tiles do not compress, so they would overstate PNG decoding (about 150 KB each
instead of the 80-100 KB of a real H&E tile). These tiles are built like stained tissue instead:
eosin (pink) stroma with holes, hematoxylin (purple) nuclei, composed by Beer-Lambert optical
density, plus a little sensor noise. Their PNGs weigh about what real tiles weigh, and decode in
about the same time. They are built once per run and shared by every path, so that every path
does exactly the same work.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
from PIL import Image

from ..cpus import usable_cpus

__all__ = ["make_bodies", "tile_png", "tissue_tile"]

# Stain vectors (optical density per unit stain, RGB), from Ruifrok & Johnston (2001).
_HEMATOXYLIN = np.array([0.65, 0.70, 0.29], dtype=np.float32)
_EOSIN = np.array([0.07, 0.99, 0.11], dtype=np.float32)
# Distinct images; the bodies reuse them under the 8 flips/rotations of the square.
_POOL = 64


def _smooth(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    grid = (rng.random((cells, cells)) * 255).astype(np.uint8)
    image = Image.fromarray(grid).resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.float32) / 255.0


@lru_cache(maxsize=_POOL)
def _base_tile(seed: int, size: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    eosin = 0.15 + 0.5 * _smooth(rng, size, 6) * (_smooth(rng, size, 20) > 0.35)
    hema = 0.05 * _smooth(rng, size, 10)
    # Nuclei: soft ellipses, each drawn only in its own neighbourhood.
    r = 12
    yy, xx = np.mgrid[-r : r + 1, -r : r + 1].astype(np.float32)
    for _ in range(int(rng.integers(15, 60))):
        cx, cy = (int(v) for v in rng.uniform(0, size, 2))
        a, b = rng.uniform(3, 8, 2)
        theta = rng.uniform(0, np.pi)
        u = (xx * np.cos(theta) + yy * np.sin(theta)) / a
        v = (-xx * np.sin(theta) + yy * np.cos(theta)) / b
        blob = 0.9 * rng.uniform(0.6, 1.2) * np.exp(-((u * u + v * v) ** 2))
        y0, y1, x0, x1 = (
            max(cy - r, 0),
            min(cy + r + 1, size),
            max(cx - r, 0),
            min(cx + r + 1, size),
        )
        hema[y0:y1, x0:x1] += blob[y0 - cy + r : y1 - cy + r, x0 - cx + r : x1 - cx + r]
    density = hema[..., None] * _HEMATOXYLIN + eosin[..., None] * _EOSIN
    return (255.0 * np.exp(-1.2 * density)).astype(np.float32)


def tissue_tile(seed: int, size: int = 224) -> np.ndarray:
    """A seeded H&E-like ``uint8`` RGB tile ``[size, size, 3]``."""
    base = _base_tile(seed % _POOL, size)
    variant = (seed // _POOL) % 8
    pixels = np.rot90(base, variant % 4)
    if variant >= 4:
        pixels = pixels[:, ::-1]
    noise = np.random.default_rng(seed + 1_000_003).normal(0.0, 3.0, pixels.shape)
    return np.clip(pixels + noise, 0, 255).astype(np.uint8)


def tile_png(seed: int, size: int = 224) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(tissue_tile(seed, size), mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def make_bodies(n: int, *, seed: int = 0, size: int = 224, slide: str = "bench-slide") -> list[str]:
    """``n`` distinct request bodies (JSON strings); body ``i`` has ``patch_idx == i``."""
    per_row = 64

    def body(i: int) -> str:
        png = tile_png(seed * 100_003 + i, size)
        return json.dumps(
            {
                "image_data": base64.b64encode(png).decode(),
                "slide_name": slide,
                "x": size * (i % per_row),
                "y": size * (i // per_row),
                "width": size,
                "height": size,
                "patch_idx": i,
                "tissue_ratio": 0.8,
                "resolution": 0.5,
            }
        )

    # numpy and zlib release the GIL: building in threads uses every core.
    with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
        return list(pool.map(body, range(n)))
