"""Fast PNG decoders, used when an optional one is installed: Wuffs, then libspng.

Why: after the forward pass, decoding is the biggest CPU cost of a request (on the bench's
224 px tiles, ~0.9 ms a tile with libspng against ~1.7 ms of forward pass), and on a small box
it runs on the same cores as the forward pass. Wuffs (the ``wuffs`` extra: ``pywuffs``, built
from source) is ~25% faster than libspng (680 vs 920 µs a tile, docs/benchmarks-history.md,
"Session 6"), and it is memory-safe by construction, which suits a server that decodes what
strangers send. Both release the GIL while they decode.

Only what a fast decoder turns into exactly Pillow's ``convert("RGB")`` pixels takes it (8-bit
only; Wuffs never gets an image with an alpha channel or a ``tRNS`` chunk, which it would
composite rather than drop). Anything else, and any image a fast decoder refuses, goes to
Pillow, whose error messages are the canonical ones (models/imaging.py).
"""

from __future__ import annotations

import importlib
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DECODERS", "FastDecoder", "PngHeader", "available_decoders", "choose", "read_header"]

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_GRAY, _RGB, _PALETTE, _RGBA = 0, 2, 3, 6


@dataclass(frozen=True, slots=True)
class PngHeader:
    """What decides which decoder may take a PNG: its IHDR, and a ``tRNS`` chunk before IDAT."""

    width: int
    height: int
    depth: int
    color_type: int
    transparency: bool


def read_header(raw: bytes) -> PngHeader | None:
    """The header of a PNG, or ``None`` when ``raw`` does not start like one."""
    if len(raw) < 33 or raw[:8] != SIGNATURE or raw[12:16] != b"IHDR":
        return None
    width, height, depth, color_type = struct.unpack(">IIBB", raw[16:26])
    return PngHeader(width, height, depth, color_type, _has_trns(raw))


#: chunks read before the first IDAT at most; a PNG with more may have a tRNS among them
_MAX_CHUNKS_BEFORE_IDAT = 64


def _has_trns(raw: bytes) -> bool:
    """Whether a tRNS chunk (it must come before the first IDAT) may be present. Walking the
    chunk headers costs a few µs; it stops after a bounded number of chunks, so a body made of
    millions of empty chunks costs nothing either, and is then assumed to have one."""
    position = 8
    for _ in range(_MAX_CHUNKS_BEFORE_IDAT):
        if position + 8 > len(raw):
            return False  # truncated before any pixel data: the decoders will refuse it
        length, kind = struct.unpack(">I4s", raw[position : position + 8])
        if kind == b"tRNS":
            return True
        if kind in (b"IDAT", b"IEND"):
            return False
        position += 12 + length
    return True


@dataclass(frozen=True)
class FastDecoder:
    """One optional decoder: which PNGs it takes, and how it decodes them."""

    name: str
    takes: Callable[[PngHeader], bool]
    #: raw PNG bytes -> ``[H, W, 3]`` uint8 array; raises on an image it cannot decode
    decode: Callable[[bytes], np.ndarray]


def _rgb(array: Any) -> np.ndarray:
    """libspng's native output (``[H, W]`` gray, ``[H, W, 3]`` RGB or ``[H, W, 4]`` RGBA) as
    contiguous ``[H, W, 3]``: gray replicated, alpha dropped, as Pillow's ``convert("RGB")``."""
    if array.ndim == 2:
        return np.repeat(array[:, :, None], 3, axis=2)
    if array.shape[2] == 4:
        return np.ascontiguousarray(array[:, :, :3])
    return np.asarray(array)


def _spng() -> FastDecoder | None:
    try:
        spng_decode = importlib.import_module("imagecodecs").spng_decode
    except (ImportError, AttributeError):
        return None
    return FastDecoder(
        "libspng (imagecodecs)",
        # 8-bit gray, RGB and RGBA: libspng's output is then Pillow's convert("RGB"), tRNS or not.
        takes=lambda h: h.depth == 8 and h.color_type in (_GRAY, _RGB, _RGBA),
        decode=lambda raw: _rgb(spng_decode(raw)),
    )


def _wuffs() -> FastDecoder | None:
    try:
        pywuffs = importlib.import_module("pywuffs")
        aux = importlib.import_module("pywuffs.aux")
    except ImportError:
        return None
    local = threading.local()  # an ImageDecoder is not thread-safe: one per thread

    def decoder() -> Any:
        found = getattr(local, "decoder", None)
        if found is None:
            config = aux.ImageDecoderConfig()
            config.enabled_decoders = [pywuffs.ImageDecoderType.PNG]
            config.pixel_format = pywuffs.PixelFormat.RGB
            # pywuffs skips the CRC-32 and Adler-32 checks unless told: a corrupt tile would
            # then decode to wrong pixels instead of being refused.
            config.quirks = {pywuffs.ImageDecoderQuirks.IGNORE_CHECKSUM: 0}
            found = local.decoder = aux.ImageDecoder(config)
        return found

    def decode(raw: bytes) -> np.ndarray:
        result = decoder().decode(bytes(raw))  # bytes: a str would be taken for a file path
        if result.error_message:
            raise ValueError(f"wuffs: {result.error_message}")
        pixels: np.ndarray = result.pixbuf  # a copy on each access: read it once
        return pixels

    return FastDecoder(
        "Wuffs (pywuffs)",
        # Opaque 8-bit images only: with alpha or tRNS, Wuffs composites where Pillow drops.
        takes=lambda h: (
            h.depth == 8 and h.color_type in (_GRAY, _RGB, _PALETTE) and not h.transparency
        ),
        decode=decode,
    )


def available_decoders() -> list[FastDecoder]:
    """The installed fast decoders, fastest first."""
    return [d for d in (_wuffs(), _spng()) if d is not None]


#: what :func:`choose` picks from; tests and the bench's profile replace or read it
DECODERS: list[FastDecoder] = available_decoders()


def choose(header: PngHeader) -> FastDecoder | None:
    """The fastest installed decoder that takes this PNG exactly, or ``None`` (Pillow)."""
    return next((d for d in DECODERS if d.takes(header)), None)
