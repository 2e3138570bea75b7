"""Fast PNG decoders, used when an optional one is installed: Wuffs, then libspng, each best
with libdeflate's inflate in front of it.

Why: after the forward pass, decoding is the biggest CPU cost of a request (on the bench's
224 px tiles, ~0.75 ms a tile with Wuffs against ~1.9 ms of forward pass), and on a small box
it runs on the same cores as the forward pass. Wuffs (the ``wuffs`` extra: ``pywuffs``, built
from source) is ~25% faster than libspng (680 vs 920 µs a tile, docs/benchmarks-history.md,
"Session 6"), and it is memory-safe by construction, which suits a server that decodes what
strangers send. Both release the GIL while they decode.

Most of a tile's decoding is inflating its pixel data (~0.72 ms of the 0.75 with zlib), and
libdeflate (in imagecodecs, the ``fast`` extra) inflates twice as fast as zlib or Wuffs. When
it is installed, the common tile (8-bit opaque gray or RGB, not interlaced) is inflated by
libdeflate, which checks the Adler-32, after every chunk's CRC-32 is checked; its scanlines
are then handed to Wuffs or libspng as a PNG whose pixel data is stored uncompressed, so they
only undo the PNG filters (``_Inflated``): 0.58 ms a tile instead of 0.75 with Wuffs, 0.61
instead of 0.99 with libspng.

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
from functools import partial
from typing import Any, ClassVar

import numpy as np

__all__ = ["DECODERS", "FastDecoder", "PngHeader", "available_decoders", "choose", "read_header"]

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_GRAY, _RGB, PALETTE, _RGBA = 0, 2, 3, 6


@dataclass(frozen=True, slots=True)
class PngHeader:
    """What decides which decoder may take a PNG: its IHDR, and a ``tRNS`` chunk before IDAT."""

    width: int
    height: int
    depth: int
    color_type: int
    transparency: bool
    interlaced: bool = False
    #: whether a PLTE chunk may be present before IDAT (a palette image without one is invalid)
    palette: bool = True


def read_header(raw: bytes) -> PngHeader | None:
    """The header of a PNG, or ``None`` when ``raw`` does not start like one."""
    if len(raw) < 33 or raw[:8] != SIGNATURE or raw[12:16] != b"IHDR":
        return None
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", raw[16:29])
    transparency, palette = _chunks_before_idat(raw)
    return PngHeader(width, height, depth, color_type, transparency, interlace != 0, palette)


#: chunks read before the first IDAT at most; a PNG with more may have a tRNS among them
_MAX_CHUNKS_BEFORE_IDAT = 64


def _chunks_before_idat(raw: bytes) -> tuple[bool, bool]:
    """Whether a tRNS and a PLTE chunk (both must come before the first IDAT) may be present.
    Walking the chunk headers costs a few µs; it stops after a bounded number of chunks, so a
    body made of millions of empty chunks costs nothing either, and is then assumed to have
    both."""
    position, transparency, palette = 8, False, False
    for _ in range(_MAX_CHUNKS_BEFORE_IDAT):
        if position + 8 > len(raw):
            break  # truncated before any pixel data: the decoders will refuse it
        length, kind = struct.unpack(">I4s", raw[position : position + 8])
        transparency = transparency or kind == b"tRNS"
        palette = palette or kind == b"PLTE"
        if kind in (b"IDAT", b"IEND"):
            break
        position += 12 + length
    else:
        return True, True
    return transparency, palette


@dataclass(frozen=True)
class FastDecoder:
    """One optional decoder: which PNGs it takes, and how it decodes them."""

    name: str
    takes: Callable[[PngHeader], bool]
    #: raw PNG bytes -> ``[H, W, 3]`` uint8 array; raises on an image it cannot decode. A fresh
    #: array the caller owns: tiles are views of it (imaging._to_tensor), never copies
    decode: Callable[[bytes], np.ndarray]


def _rgb(array: Any) -> np.ndarray:
    """libspng's native output (``[H, W]`` gray, ``[H, W, 3]`` RGB or ``[H, W, 4]`` RGBA) as
    contiguous ``[H, W, 3]``: gray replicated, alpha dropped, as Pillow's ``convert("RGB")``."""
    if array.ndim == 2:
        return np.repeat(array[:, :, None], 3, axis=2)
    if array.shape[2] == 4:
        return np.ascontiguousarray(array[:, :, :3])
    return np.asarray(array)


class _Inflated:
    """libdeflate's inflate in front of a decoder that then only undoes the PNG filters.

    The PNG's chunks are walked to IEND and each CRC-32 checked (as Wuffs and libspng check
    them); its IDAT payloads are inflated by libdeflate, which checks the Adler-32 and refuses
    a stream that does not give exactly the image's scanlines. Those scanlines become a new
    PNG (the same signature and IHDR) whose zlib stream is made of stored blocks: the decoder
    behind copies them and unfilters. Anything unexpected raises, and the tile goes to Pillow.
    """

    #: a stored deflate block carries at most this many bytes
    BLOCK = 65535
    #: chunks walked at most; a PNG with more goes to Pillow
    MAX_CHUNKS = 1024
    CHANNELS: ClassVar[dict[int, int]] = {_GRAY: 1, _RGB: 3}
    IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"

    def __init__(self, codecs: Any) -> None:
        self.inflate = codecs.deflate_decode
        self.crc32 = codecs.deflate_crc32
        self.adler32 = codecs.deflate_adler32

    @classmethod
    def takes(cls, header: PngHeader) -> bool:
        return (
            header.depth == 8
            and header.color_type in cls.CHANNELS
            and not header.transparency
            and not header.interlaced
        )

    def scanlines(self, raw: bytes) -> bytes:
        """The filtered scanlines of an image :meth:`takes` takes, every checksum checked."""
        if raw[8:12] != b"\x00\x00\x00\x0d":  # IHDR is 13 bytes: :meth:`stored` copies it so
            raise ValueError("an IHDR chunk that is not 13 bytes long")
        width, height, _, color_type = struct.unpack_from(">IIBB", raw, 16)
        size = height * (1 + width * self.CHANNELS[color_type])
        view = memoryview(raw)
        payloads: list[memoryview] = []
        previous, position = b"", 8
        for _ in range(self.MAX_CHUNKS):
            length, kind = struct.unpack_from(">I4s", raw, position)
            end = position + 8 + length
            (crc,) = struct.unpack_from(">I", raw, end)  # past the end: struct.error
            if self.crc32(view[position + 4 : end]) != crc:
                raise ValueError(f"bad CRC-32 in a {kind!r} chunk")
            if kind == b"IDAT":
                if payloads and previous != b"IDAT":
                    # The spec wants them consecutive; Pillow would not read past the gap.
                    raise ValueError("IDAT chunks separated by another chunk")
                payloads.append(view[position + 8 : end])
            elif kind == b"IEND":
                break
            previous = kind
            position = end + 4
        else:
            raise ValueError(f"more than {self.MAX_CHUNKS} chunks")
        data = payloads[0] if len(payloads) == 1 else b"".join(payloads)
        rows: bytes = self.inflate(data, out=size)  # a longer stream: INSUFFICIENT_SPACE
        if len(rows) != size:
            raise ValueError(f"pixel data inflates to {len(rows)} bytes, not {size}")
        return rows

    def stored(self, raw: bytes, rows: bytes, checksums: bool) -> bytes:
        """A PNG of ``raw``'s IHDR and ``rows`` stored uncompressed; its CRC-32 and Adler-32
        are computed only if ``checksums`` (a decoder told to skip them needs none)."""
        view = memoryview(rows)
        stream: list[bytes | memoryview] = [b"\x78\x01"]  # zlib header: deflate, no preset
        for start in range(0, len(rows), self.BLOCK):
            block = view[start : start + self.BLOCK]
            final = start + self.BLOCK >= len(rows)
            stream += [struct.pack("<BHH", final, len(block), len(block) ^ 0xFFFF), block]
        adler = self.adler32(rows) if checksums else 0
        stream.append(struct.pack(">I", adler))
        length = sum(len(part) for part in stream)
        crc = 0
        if checksums:
            crc = self.crc32(b"IDAT")
            for part in stream:
                crc = self.crc32(part, crc)
        head = raw[:33] + struct.pack(">I4s", length, b"IDAT")
        return b"".join([head, *stream, struct.pack(">I", crc), self.IEND])


def _libdeflate() -> _Inflated | None:
    try:
        codecs = importlib.import_module("imagecodecs")
        return _Inflated(codecs) if codecs.DEFLATE.available else None
    except (ImportError, AttributeError):  # not installed, or built without libdeflate
        return None


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


def _wuffs() -> tuple[FastDecoder, Callable[[bytes], np.ndarray]] | None:
    """Wuffs, and how it decodes a PNG whose checksums were checked already (_Inflated)."""
    try:
        pywuffs = importlib.import_module("pywuffs")
        aux = importlib.import_module("pywuffs.aux")
    except ImportError:
        return None
    local = threading.local()  # an ImageDecoder is not thread-safe: one per thread

    def decoder(checksums: bool) -> Any:
        kind = "strict" if checksums else "loose"
        found = getattr(local, kind, None)
        if found is None:
            config = aux.ImageDecoderConfig()
            config.enabled_decoders = [pywuffs.ImageDecoderType.PNG]
            config.pixel_format = pywuffs.PixelFormat.RGB
            # pywuffs skips the CRC-32 and Adler-32 checks unless told: a corrupt tile would
            # then decode to wrong pixels instead of being refused. Only a PNG whose checksums
            # were checked before it was stored (_Inflated) goes without.
            config.quirks = {pywuffs.ImageDecoderQuirks.IGNORE_CHECKSUM: int(not checksums)}
            found = aux.ImageDecoder(config)
            setattr(local, kind, found)
        return found

    def decode(raw: bytes, checksums: bool = True) -> np.ndarray:
        result = decoder(checksums).decode(bytes(raw))  # bytes: a str is taken for a path
        if result.error_message:
            raise ValueError(f"wuffs: {result.error_message}")
        pixels: np.ndarray = result.pixbuf  # a copy on each access: read it once
        return pixels

    alone = FastDecoder(
        "Wuffs (pywuffs)",
        # Opaque 8-bit images only: with alpha or tRNS, Wuffs composites where Pillow drops.
        # A palette image without its PLTE goes to Pillow too, which refuses it (imaging.py).
        takes=lambda h: (
            h.depth == 8
            and h.color_type in (_GRAY, _RGB, PALETTE)
            and not h.transparency
            and (h.palette or h.color_type != PALETTE)
        ),
        decode=decode,
    )
    return alone, partial(decode, checksums=False)


def _behind_libdeflate(
    inflated: _Inflated, name: str, decode_stored: Callable[[bytes], np.ndarray], checksums: bool
) -> FastDecoder:
    """``decode_stored`` unfiltering what libdeflate inflated; ``checksums``: whether it
    checks them (then the stored PNG carries real ones)."""

    def decode(raw: bytes) -> np.ndarray:
        return decode_stored(inflated.stored(raw, inflated.scanlines(raw), checksums))

    return FastDecoder(f"libdeflate + {name}", inflated.takes, decode)


def available_decoders() -> list[FastDecoder]:
    """The installed fast decoders, fastest first: each with libdeflate in front, then each
    alone (for what the former do not take)."""
    inflated, wuffs, spng = _libdeflate(), _wuffs(), _spng()
    found: list[FastDecoder] = []
    if inflated is not None and wuffs is not None:
        found.append(_behind_libdeflate(inflated, "Wuffs", wuffs[1], checksums=False))
    if inflated is not None and spng is not None:
        found.append(_behind_libdeflate(inflated, spng.name, spng.decode, checksums=True))
    return found + [d for d in (wuffs and wuffs[0], spng) if d is not None]


#: what :func:`choose` picks from; tests and the bench's profile replace or read it
DECODERS: list[FastDecoder] = available_decoders()


def choose(header: PngHeader) -> FastDecoder | None:
    """The fastest installed decoder that takes this PNG exactly, or ``None`` (Pillow)."""
    return next((d for d in DECODERS if d.takes(header)), None)
