"""Tile decoding: base64 -> PNG/JPEG/TIFF -> RGB -> resized ``uint8`` tensor ``[3, H, W]``.

Decoding stops at uint8 on purpose: normalization runs on the device's thread, as each tile is
copied into the float batch (:meth:`ServerModel.forward_tiles`; on a GPU, once per batch in
``forward_batch``), which keeps this step's output four times smaller and its threads free.
"""

from __future__ import annotations

import binascii
import io
import logging
import re
import struct
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Imported for their side effect: each registers its format's (factory, accept) in Image.OPEN.
from PIL import JpegImagePlugin, PngImagePlugin, TiffImagePlugin  # noqa: F401  # isort: skip

from ..errors import InvalidRequestError
from . import png
from .faults import base64_fault, missing_tiff_codec, unsupported_reason

__all__ = ["ACCEPTED_FORMATS", "MAX_JPEG_SCANS", "MAX_TIFF_STRIPS", "decode_tile"]

log = logging.getLogger("histoinfer.tiles")
_stretched_said = False

ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "TIFF"})
#: Most scans a JPEG's image may have. Each scan is a pass over the whole image: a small
#: progressive JPEG that repeats a cheap scan thousands of times costs seconds to decode within
#: every size limit (a 4096 x 4096 image: ~2 ms a scan). Encoders write 1 (baseline) to ~10
#: (progressive).
MAX_JPEG_SCANS = 100
# Pixel modes that convert to RGB without losing meaning (32-bit and float modes would clip).
#: grayscale of 16 bits a pixel (Pillow's modes for a 16-bit PNG or TIFF), read by its high
#: byte; 32-bit ``I`` stays refused (its values over 65535 would be clipped)
_WIDE_GRAY = frozenset({"I;16", "I;16B", "I;16L"})
_CONVERTIBLE_MODES = frozenset(
    {"RGB", "RGBA", "RGBX", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1", *_WIDE_GRAY}
)

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}

# Formats users send by mistake, by magic number, so the error can say what was sent.
_OTHER_FORMATS = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
)


def _open(raw: bytes) -> Image.Image:
    """``Image.open(formats=ACCEPTED_FORMATS)`` without Pillow's decompression-bomb check.

    Image.open warns (DecompressionBombWarning) for a header declaring more than ~89 M pixels,
    before our own, lower limit can refuse the image with its own error: a warning in the
    caller's logs, or an exception where warnings are errors. ``warnings.catch_warnings`` is not
    thread-safe (tiles decode on many threads), so the formats are opened here, as Image.open
    does, and the size is checked by the caller before any pixel is decoded.
    """
    prefix = raw[:16]
    recognized = ""
    for name in sorted(ACCEPTED_FORMATS):
        factory, accept = Image.OPEN[name]
        accepted = accept is None or accept(prefix)
        if isinstance(accepted, str) or not accepted:  # a str: "looks like it, unsupported"
            continue
        try:
            return factory(io.BytesIO(raw), "")
        except (SyntaxError, IndexError, TypeError, struct.error) as exc:
            unsupported = unsupported_reason(name, raw, exc)
            if unsupported:
                raise _Unsupported(f"a {name} image {unsupported}") from None
            recognized = recognized or name  # its signature, but not readable as one
    if recognized:
        raise _Damaged(recognized)
    raise UnidentifiedImageError("cannot identify image file")


class _Damaged(UnidentifiedImageError):
    """An image with an accepted format's signature that cannot be read as one."""

    def __init__(self, format_name: str) -> None:
        super().__init__(f"a damaged or truncated {format_name} image")


class _Unsupported(UnidentifiedImageError):
    """A well-formed image of an accepted format, in a pixel format or compression that Pillow
    cannot represent or decode (float or signed samples, JPEG 2000 in a TIFF, 12-bit JPEG)."""


def _unaccepted_format(raw: bytes) -> str:
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WebP"
    if raw[4:12] in (b"ftypavif", b"ftypheic", b"ftypmif1"):
        return "AVIF/HEIF"
    return next((name for magic, name in _OTHER_FORMATS if raw.startswith(magic)), "")


# Optional fast paths: SIMD base64 (the `fast` extra; binascii holds the GIL for ~250 µs on a
# 100 KB tile), and the PNG decoders of models/png.py (Wuffs, libspng), which release the GIL.
def _b64decode_stdlib(data: str) -> bytes:
    """binascii's strict decoding, refusing what pybase64's refuses too: padding after a
    complete quantum ("QUJD=", "QUJD====" decode in binascii's strict mode), so that a body is
    valid or not whichever is installed."""
    padding = len(data) - len(data.rstrip("="))
    if padding > 2 or (padding and len(data) % 4):
        raise binascii.Error("Excess padding after the last quantum")
    return binascii.a2b_base64(data, strict_mode=True)


_b64decode: Callable[[str], bytes]
try:
    import pybase64

    def _b64decode(data: str) -> bytes:
        return pybase64.b64decode(data, validate=True)

except ImportError:  # pragma: no cover - exercised where the extra is missing
    _b64decode = _b64decode_stdlib


def _to_tensor(pixels: torch.Tensor, tile_size: int) -> torch.Tensor:
    """HWC bytes -> a ``[3, T, T]`` uint8 tile: a view of the pixels as decoded, no copy.

    The batch the tile joins is laid out channels-last where the model allows it
    (``ServerModel.batch_layout``): its row is then a plain copy of these bytes. Until session
    17 this made a contiguous ``[3, T, T]`` copy (numpy's transpose: ~0.1 ms of a decode
    thread's CPU for 224 px; a torch copy would have been a parallel op, giving every decode
    thread an OpenMP team: models/device_thread.py); a contiguous batch now makes that
    transposing copy as it fills its rows, on the device's thread."""
    return pixels.view(tile_size, tile_size, 3).permute(2, 0, 1)


#: Marker segments a JPEG may have at most (encoders write ~10-40, and a progressive JPEG a few
#: more a scan): Pillow's header parser handles each in Python (7.5 M empty comments: ~11 s).
_MAX_JPEG_SEGMENTS = 1000
#: Bytes a JPEG may have between its segments, where a marker should be: Pillow's parser steps
#: over them one at a time in Python (30 MB of them: ~3 s).
_MAX_JPEG_JUNK = 64 * 1024
# The next marker in entropy-coded data: 0xFF not followed by a stuffed 0x00 or a restart.
_NEXT_MARKER = re.compile(rb"\xff(?![\x00\xd0-\xd7])")
_MARKER = re.compile(rb"\xff(?!\xff)")  # a marker's 0xFF: fill bytes (0xFF) may precede it


def _jpeg_fault(raw: bytes) -> str | None:
    """Why a JPEG (or MPO) would cost seconds to decode within every size limit, found before
    Pillow parses it: too many scans (each a pass over the whole image), segments, or bytes
    between segments. The first image is walked (up to its EOI): segments are skipped by their
    lengths (so a thumbnail in APP1 is not counted), entropy-coded data and fill bytes by a C
    search (so trailing data, an MPO's other frames or a motion photo's video, is not either).
    Anything else malformed ends the walk: the decoder refuses it."""
    position, scans, junk = 2, 0, 0  # after SOI
    for _ in range(_MAX_JPEG_SEGMENTS):
        # The next marker's 0xFF (the last of a run of fill bytes); whatever comes before it
        # is stepped over one byte at a time by Pillow's parser. Looked for no further than
        # would be too much: a search through 30 MB of fill bytes took 0.4 s.
        window = position + _MAX_JPEG_JUNK + 2
        found = _MARKER.search(raw, position, window)
        junk += (min(len(raw), window) if found is None else found.start()) - position
        if junk > _MAX_JPEG_JUNK:
            return (
                f"a damaged JPEG (over {_MAX_JPEG_JUNK:,} bytes between its segments, "
                "where markers belong)"
            )
        if found is None or len(raw) < found.start() + 4:
            return None
        position = found.start()
        marker = raw[position + 1]
        if marker == 0xD9:  # EOI
            return None
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # no length
            position += 2
            continue
        position += 2 + int.from_bytes(raw[position + 2 : position + 4], "big")
        if marker == 0xDA:  # SOS: its header, then entropy-coded data up to the next marker
            scans += 1
            if scans > MAX_JPEG_SCANS:
                return (
                    f"a JPEG of over {MAX_JPEG_SCANS} scans (re-encode it as baseline or "
                    "standard progressive)"
                )
            found_marker = _NEXT_MARKER.search(raw, position)
            if found_marker is None:
                return None
            position = found_marker.start()
    return f"a JPEG of over {_MAX_JPEG_SEGMENTS:,} segments (encoders write a few dozen)"


#: Strips (or tiles) a TIFF may have, at least: Pillow sets up each in Python (~10-15 us
#: each), and a 1-pixel wide image of 2 M rows, one strip a row, is 2 M of them within the
#: pixel limit (~20 s). Beyond this, one a 256 pixels of the pixel limit is allowed (65,536 at
#: the default 4096 x 4096: ~1 s at most), which takes libtiff's default strips (~8 KB),
#: planar rows of one row each, and 16-px tiles of the largest image taken.
MAX_TIFF_STRIPS = 8192
#: Tags a TIFF's first directory may have (a file has ~10-40; Pillow reads each in Python).
_MAX_TIFF_TAGS = 1024
_TIFF_OFFSETS = {273: "strips", 324: "tiles"}  # StripOffsets, TileOffsets


def _tiff_fault(raw: bytes, max_image_pixels: int) -> str | None:
    """Why a TIFF would cost seconds to set up within every size limit, read from its first
    directory before Pillow parses it: too many tags, strips or tiles. Anything malformed is
    left to Pillow, which refuses it."""
    order = {b"II": "<", b"MM": ">"}.get(raw[:2])
    if order is None:
        return None
    try:
        (magic,) = struct.unpack_from(order + "H", raw, 2)
        if magic == 42:  # classic: 2-byte tag count, 12-byte entries with 4-byte counts
            (offset,) = struct.unpack_from(order + "I", raw, 4)
            (tags,) = struct.unpack_from(order + "H", raw, offset)
            entry, layout, first = 12, order + "HHI", offset + 2
        elif magic == 43:  # BigTIFF: 8-byte tag count, 20-byte entries with 8-byte counts
            (offset,) = struct.unpack_from(order + "Q", raw, 8)
            (tags,) = struct.unpack_from(order + "Q", raw, offset)
            entry, layout, first = 20, order + "HHQ", offset + 8
        else:
            return None
        if offset < 8 or first + tags * entry > len(raw):
            return None  # a directory not where it says, or not all there: Pillow refuses it
        if tags > _MAX_TIFF_TAGS:
            return f"a TIFF of {tags:,} tags in its first directory (at most {_MAX_TIFF_TAGS:,})"
        most = max(MAX_TIFF_STRIPS, max_image_pixels // 256)
        for index in range(tags):
            tag, _, count = struct.unpack_from(layout, raw, first + index * entry)
            if tag in _TIFF_OFFSETS and count > most:
                kind = _TIFF_OFFSETS[tag]
                return (
                    f"a TIFF of {count:,} {kind} (at most {most:,}: save it with fewer, "
                    f"larger {kind})"
                )
    except struct.error:  # truncated: Pillow says so
        return None
    return None


def _resized(rgb: Image.Image, tile_size: int, interpolation: str) -> torch.Tensor:
    """An RGB image as a tile, resized to ``tile_size`` with the model's interpolation."""
    if rgb.size != (tile_size, tile_size):
        rgb = rgb.resize((tile_size, tile_size), _RESAMPLE[interpolation])
    return _to_tensor(torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8), tile_size)


def decode_tile(
    image_data: str,
    *,
    width: int,
    height: int,
    tile_size: int,
    interpolation: str,
    max_image_bytes: int,
    max_image_pixels: int,
    where: str,
) -> torch.Tensor:
    """Decode one tile; every failure is an :class:`InvalidRequestError` naming ``where``."""

    def invalid(reason: str) -> InvalidRequestError:
        return InvalidRequestError(f"invalid request {where}: field 'image_data': {reason}")

    if len(image_data) > (max_image_bytes * 4) // 3 + 4:
        raise invalid(f"encoded image is larger than the {max_image_bytes}-byte limit")
    if image_data.startswith("data:"):
        raise invalid("send the bare base64 payload, without the 'data:...;base64,' prefix")
    try:
        raw = _b64decode(image_data)
    except (binascii.Error, ValueError):
        # Worded from the data itself: pybase64 and binascii word (and order) faults differently.
        fault = base64_fault(image_data)
        raise invalid(f"not valid base64: {fault}" if fault else "not valid base64") from None
    if not raw:
        raise invalid("image is empty")

    def check_size(image_width: int, image_height: int) -> None:
        if image_width * image_height > max_image_pixels:
            raise invalid(
                f"image is {image_width}x{image_height}, over the {max_image_pixels}-pixel limit"
            )
        if (image_width, image_height) != (width, height):
            raise InvalidRequestError(
                f"invalid request {where}: fields 'width'/'height' say {width}x{height} "
                f"but the decoded image is {image_width}x{image_height}"
            )
        if image_width != image_height:
            _say_stretched(image_width, image_height, tile_size, where)

    header = png.read_header(raw)
    if header is not None:
        # From the header, for any PNG: a bomb costs nothing, and Pillow never sees one.
        check_size(header.width, header.height)
        fast = png.choose(header)
        try:
            array = fast.decode(raw) if fast is not None else None
        except Exception:
            array = None  # corrupt or truncated: Pillow below gives the canonical error message
        if array is not None:
            if (header.width, header.height) == (tile_size, tile_size):
                return _to_tensor(torch.from_numpy(array), tile_size)
            return _resized(Image.fromarray(array), tile_size, interpolation)
    # Before Pillow parses the header, which is where these cost seconds. JPEG and MPO alike;
    # JPEG-compressed TIFF strips need no scan count: libtiff refuses a strip of over 100 itself.
    jpeg = raw[:3] == b"\xff\xd8\xff"
    costly = _jpeg_fault(raw) if jpeg else _tiff_fault(raw, max_image_pixels)
    if costly is not None:
        raise invalid(costly)
    try:
        image = _open(raw)
    except _Unsupported as exc:
        raise invalid(str(exc)) from None
    except _Damaged as exc:
        raise invalid(f"{exc} (it cannot be read)") from None
    except UnidentifiedImageError:
        other = _unaccepted_format(raw)
        article = "an" if other[:1] in ("A", "E", "I", "O", "U") else "a"
        sent = f"{article} {other} image" if other else "an unrecognized format"
        raise invalid(f"not a PNG, JPEG or TIFF image ({sent})") from None
    except Exception as exc:
        raise invalid(
            f"not a decodable PNG, JPEG or TIFF image ({type(exc).__name__}: {exc})"
        ) from None
    with image:
        check_size(image.width, image.height)
        if image.mode not in _CONVERTIBLE_MODES:
            raise invalid(f"pixel mode {image.mode!r} is not supported (use 8-bit RGB)")
        if image.mode in ("P", "PA") and image.palette is None:
            # No fast decoder takes one (png.py); converted, Pillow would make up the colours
            # (a wrong answer) or fail an assert.
            raise invalid(
                f"a palette {image.format} without its PLTE chunk (the palette is missing)"
            )
        lacking = missing_tiff_codec(image)  # before libtiff tries, and writes to stderr
        if lacking:
            raise invalid(f"a TIFF image {lacking}")
        try:
            image.load()
        except Exception as exc:
            raise invalid(
                f"image data is corrupt or truncated ({type(exc).__name__}: {exc})"
            ) from None
        try:
            return _resized(_rgb(image), tile_size, interpolation)
        except Exception as exc:  # Pillow's own checks (asserts) on an inconsistent image
            raise invalid(
                f"image cannot be converted to RGB ({type(exc).__name__}: {exc})"
            ) from None


def _say_stretched(width: int, height: int, tile_size: int, where: str) -> None:
    """Once a process: a tile that is not square is stretched to the model's square tile (its
    answer is computed, as documented, but its tissue is distorted: a slide's edge tiles, cut
    short, are the usual case, and a trial found nothing said so)."""
    global _stretched_said
    if _stretched_said:
        return
    _stretched_said = True
    log.warning(
        "a %dx%d tile (%s) is resized to %dx%d, which stretches it; pad a slide's edge tiles "
        "to square, or leave them out (said once a process)",
        width,
        height,
        where.removeprefix("for "),
        tile_size,
        tile_size,
    )


def _rgb(image: Image.Image) -> Image.Image:
    """``image`` as RGB, alpha and transparency dropped. A palette image with transparency
    goes through RGBA: converted straight to RGB, Pillow warns on every such image ("should be
    converted to RGBA"), which would fill a server's log (the pixels are the same)."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in _WIDE_GRAY:
        # Its high byte, as Pillow reads a 16-bit RGB PNG (SPEC §3.1: grayscale is converted).
        # Pillow's own convert("L") clips at 255: every pixel of a 16-bit image was white.
        # (Shifted as uint16, in place: no wider copy of a 4096² image.)
        high = np.asarray(image, dtype=np.uint16) >> 8
        image = Image.fromarray(high.astype(np.uint8))  # 2-D uint8: "L"
    return image.convert("RGB")
