"""Request builders shared by the tests (tiny tiles, seeded pixels, loopback only), and the
app served in-process."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import torch
from PIL import Image


def tile_bytes(seed: int = 0, size: int = 224, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A seeded random tile, encoded as ``fmt`` in pixel ``mode``."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    shape: tuple[int, ...] = (size, size, channels) if channels > 1 else (size, size)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buf, format=fmt)
    return buf.getvalue()


def request_dict(i: int = 0, size: int = 224, **overrides: Any) -> dict[str, Any]:
    """A valid request for tile ``i`` (x, y and patch_idx derived from ``i``)."""
    body: dict[str, Any] = {
        "image_data": base64.b64encode(tile_bytes(i, size)).decode(),
        "slide_name": "slide-001",
        "x": 224 * i,
        "y": 448,
        "width": size,
        "height": size,
        "patch_idx": i,
        "tissue_ratio": 0.75,
        "resolution": 0.5,
    }
    body.update(overrides)
    return body


def make_body(i: int = 0, size: int = 224, **overrides: Any) -> str:
    """``request_dict`` as a JSON string (what the Client protocol takes)."""
    return json.dumps(request_dict(i, size, **overrides))


def outputs_close(a: str, b: str, tol: float = 1e-4) -> bool:
    """Two response JSON strings agree: same fields, floats within ``tol``."""
    ra, rb = json.loads(a), json.loads(b)
    if set(ra) != set(rb):
        return False
    for key in ra:
        if key in ("output", "embedding"):
            if len(ra[key]) != len(rb[key]):
                return False
            if not np.allclose(ra[key], rb[key], atol=tol, rtol=0):
                return False
        elif ra[key] != rb[key]:
            return False
    return True


@asynccontextmanager
async def serving(app: Any, *, ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan and talk to it in-process; wait for readiness if asked."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            if ready:
                with anyio.fail_after(30):
                    while (await http.get("/health/ready")).status_code != 200:
                        await anyio.sleep(0.02)
            yield http


def save_program(module: torch.nn.Module, folder: Path) -> Path:
    """``module`` exported over ``folder``'s ``model.pt2`` (a 224 px tile batch, dynamic)."""
    path = folder / "model.pt2"
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        module, (torch.zeros(2, 3, 224, 224),), dynamic_shapes={"x": {0: batch}}
    )
    torch.export.save(program, str(path))
    return path
