"""Request bodies from tiles in memory: :func:`tile_body`.

A tile read with OpenSlide (``read_region``: an RGBA PIL image), tiffslide or cuCIM (numpy),
or cut from any ``uint8`` array becomes the JSON string every client takes
(docs/wire-format.md), with its pixels in an RGB PNG.
"""

from __future__ import annotations

import base64
import io
import json
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from PIL import Image

from .schema import MAX_INT

__all__ = ["tile_body"]

#: zlib level of the PNG: on 224-px H&E-like tiles level 1 is within ~5-15% of the default
#: level 6's size (~90-95 KiB against ~85-90) in about half its time; level 0 (stored) is
#: 1.6x larger
PNG_COMPRESS_LEVEL = 1

_ACCEPTED = (
    "a PIL Image, or a numpy uint8 array of shape (H, W, 3) RGB, (H, W, 4) RGBA, or (H, W) or "
    "(H, W, 1) grayscale"
)

#: PIL modes whose samples are not 8-bit: converting them to RGB clips (16/32-bit integers) or
#: truncates (float) silently, so they are refused, as the server refuses such PNGs
_WIDE_MODES = ("I", "F")


def tile_body(
    tile: Image.Image | np.ndarray[Any, Any],
    *,
    slide_name: str,
    x: int | np.integer[Any],
    y: int | np.integer[Any],
    patch_idx: int | np.integer[Any],
    tissue_ratio: float | np.floating[Any] | None = None,
    resolution: float | np.floating[Any] | None = None,
    background: Sequence[int] = (255, 255, 255),
    image_format: Literal["png", "tiff"] = "png",
) -> str:
    """One tile as a request body (a JSON string), ready for any client's ``predict*`` call.

    ``tile`` is a PIL Image of an 8-bit mode (``RGB``, ``RGBA``, ``L``, ``LA``, ``P``, ``1``,
    ``CMYK``...) or a numpy ``uint8`` array: ``(H, W, 3)`` RGB, ``(H, W, 4)`` RGBA, or ``(H, W)``
    or ``(H, W, 1)`` grayscale. Anything else (float or 16-bit pixels, other shapes, an empty
    tile) is refused with a :class:`TypeError` or :class:`ValueError`. The pixels are sent as
    an RGB PNG, and ``width``/``height`` are the tile's.

    **Transparency is composited over** ``background`` (RGB, default white) before the alpha
    channel is dropped: ``out = (pixel * alpha + background * (255 - alpha)) / 255``, rounded.
    OpenSlide's ``read_region`` returns RGBA with fully transparent ``(0, 0, 0, 0)`` pixels
    outside the scanned area (and ``background`` should then be the slide's background colour,
    white for brightfield H&E). The server drops alpha without compositing (by design: it
    cannot know the slide's background), so those pixels would reach the model as **black**,
    which an H&E model has never seen; ``tile.convert("RGB")`` does the same. An opaque tile
    is sent unchanged. A palette or grayscale image with a transparent colour (``tRNS``) is
    treated as RGBA.

    ``x``, ``y`` (level-0 pixel coordinates of the tile's top-left corner) and ``patch_idx``
    are integers >= 0 (numpy integers are accepted); ``tissue_ratio`` in [0, 1] and
    ``resolution`` (µm/px) > 0 are optional metadata, echoed in the response.

    ``image_format="tiff"`` sends the pixels as an uncompressed TIFF instead of a PNG: the
    same answer, made ~5x faster or more (a 224-px tile: ~0.2-1.3 ms against ~6-7 ms for
    the PNG, which on a 2-core machine can cost more than the inference) and decoded faster,
    but 1.1-1.7x larger. For ``InProcessClient``, where the body never crosses a network;
    over HTTP, the PNG's smaller body usually pays.
    """
    if image_format not in ("png", "tiff"):
        raise ValueError(f"image_format must be 'png' or 'tiff', got {image_format!r}")
    if not isinstance(slide_name, str):
        raise TypeError(f"slide_name must be a str, got {type(slide_name).__name__}")
    fields: dict[str, Any] = {
        "slide_name": slide_name,
        "x": _non_negative_int("x", x),
        "y": _non_negative_int("y", y),
        "patch_idx": _non_negative_int("patch_idx", patch_idx),
    }
    if tissue_ratio is not None:
        ratio = _float("tissue_ratio", tissue_ratio)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"tissue_ratio must be in [0, 1], got {tissue_ratio!r}")
        fields["tissue_ratio"] = ratio
    if resolution is not None:
        res = _float("resolution", resolution)
        if not 0.0 < res < math.inf:
            raise ValueError(f"resolution must be a finite float > 0 (µm/px), got {resolution!r}")
        fields["resolution"] = res
    rgb = _rgb_pixels(tile, _background(background))
    height, width = rgb.shape[:2]
    encoded = io.BytesIO()
    if image_format == "png":
        Image.fromarray(rgb).save(encoded, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    else:
        Image.fromarray(rgb).save(encoded, format="TIFF")
    body = {
        "image_data": base64.b64encode(encoded.getbuffer()).decode("ascii"),
        "width": width,
        "height": height,
        **fields,
    }
    return json.dumps(body)


def _rgb_pixels(tile: Any, background: np.ndarray) -> np.ndarray:
    """``tile`` as a ``uint8`` ``(H, W, 3)`` array, transparency composited over ``background``."""
    if isinstance(tile, Image.Image):
        pixels = _pil_pixels(tile)
    elif isinstance(tile, np.ndarray):
        pixels = _array_pixels(tile)
    else:
        hint = ""
        if hasattr(tile, "__array__") or hasattr(tile, "__cuda_array_interface__"):
            hint = " (convert it first: numpy.asarray(tile), or tile.get() for a CuPy array)"
        raise TypeError(f"tile must be {_ACCEPTED}; got {type(tile).__qualname__}{hint}")
    if pixels.shape[0] == 0 or pixels.shape[1] == 0:
        raise ValueError(f"tile is empty ({pixels.shape[1]}x{pixels.shape[0]} pixels)")
    if pixels.ndim == 2:
        return np.repeat(pixels[:, :, None], 3, axis=2)
    if pixels.shape[2] == 4:
        return _composite(pixels, background)
    return pixels


def _pil_pixels(image: Image.Image) -> np.ndarray:
    mode = image.mode
    if mode.startswith(_WIDE_MODES):
        raise ValueError(
            f"tile is a PIL Image of mode {mode!r} (16/32-bit or float samples), which would be "
            f"clipped to 8 bits; accepted: {_ACCEPTED} (scale it to uint8 first)"
        )
    if image.width == 0 or image.height == 0:
        raise ValueError(f"tile is empty ({image.width}x{image.height} pixels)")
    if mode == "RGB":
        return np.asarray(image)
    transparent = "A" in mode or "a" in mode or "transparency" in image.info
    try:
        converted = image.convert("RGBA" if transparent else "RGB")
    except ValueError as exc:  # modes Pillow cannot convert (e.g. LAB, HSV)
        raise ValueError(f"tile is a PIL Image of mode {mode!r}, not convertible: {exc}") from None
    return np.asarray(converted)


def _array_pixels(array: np.ndarray) -> np.ndarray:
    what = f"a numpy array of dtype {array.dtype} and shape {array.shape}"
    if array.dtype != np.uint8:
        hint = ""
        if array.dtype.kind == "f":
            hint = " (float pixels are ambiguous, 0-1 or 0-255: scale and cast to uint8 first)"
        raise TypeError(f"tile is {what}; accepted: {_ACCEPTED}{hint}")
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))):
        raise ValueError(f"tile is {what}; accepted: {_ACCEPTED}")
    return array[:, :, 0] if array.ndim == 3 and array.shape[2] == 1 else array


def _composite(rgba: np.ndarray, background: np.ndarray) -> np.ndarray:
    alpha = rgba[:, :, 3:4]
    if bool((alpha == 255).all()):
        return np.ascontiguousarray(rgba[:, :, :3])
    a = alpha.astype(np.uint32)
    blended = rgba[:, :, :3].astype(np.uint32) * a + background * (255 - a)
    out: np.ndarray = ((blended + 127) // 255).astype(np.uint8)
    return out


def _background(colour: Sequence[int]) -> np.ndarray:
    try:
        values = tuple(colour)
    except TypeError:
        values = ()
    if len(values) != 3 or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= int(v) <= 255
        for v in values
    ):
        raise ValueError(f"background must be an (R, G, B) of ints in 0-255, got {colour!r}")
    return np.array([int(v) for v in values], dtype=np.uint32)


def _non_negative_int(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    number = int(value)
    if not 0 <= number <= MAX_INT:
        raise ValueError(f"{name} must be in 0-{MAX_INT} (2**53 - 1), got {number}")
    return number


def _float(name: str, value: Any) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if isinstance(value, np.floating) and value.dtype.itemsize < 8:
        # np.float32(0.3) is 0.30000001192092896 as a double: echoed so in the response. Its
        # own shortest digits ("0.3") are what the caller meant.
        return float(str(value))
    return float(value)
