"""Why a tile's data was refused, in words: worked out on the error path only, once a decoder
has refused it (models/imaging.py). The decoders' own words depend on which one ran (pybase64
or binascii, and their order of checks) or are Pillow's internals ("unknown pixel mode", a bare
KeyError number): a user must read the same, precise reason from a server as in-process.
"""

from __future__ import annotations

import io
import re
from functools import cache

from PIL import Image, TiffImagePlugin

__all__ = ["base64_fault", "missing_tiff_codec", "unsupported_reason"]


_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/=]")
_INNER_PADDING = re.compile(r"=+[^=]")


def base64_fault(data: str) -> str:
    """What makes ``data`` invalid strict base64, in the same words whichever decoder refused it
    (computed only once one has); "" for data both decoders accept. Faults are reported in this
    order: a character outside the alphabet, padding before the end, then the length."""
    bad = _NOT_BASE64.search(data)
    if bad:
        char = bad.group()
        if char in "-_":
            hint = " (URL-safe base64? send the standard alphabet, with '+' and '/')"
        elif char.isspace():
            hint = " (send the base64 without spaces or line breaks)"
        else:
            hint = ""
        return f"character {char!r} at offset {bad.start()} is not in the base64 alphabet{hint}"
    inner = _INNER_PADDING.search(data)
    if inner:
        return f"padding '=' in the middle of the data, at offset {inner.start()}"
    padding = len(data) - len(data.rstrip("="))
    tail = (len(data) - padding) % 4  # characters in the last, incomplete group
    if tail == 1:
        return (
            f"length {len(data)}: the last group has a single character, which encodes nothing "
            "(the data is truncated, or has a character too many)"
        )
    needed = (4 - tail) % 4
    if padding > needed:
        if not needed:
            return f"excess padding: {padding} '=' after a complete group of 4 characters"
        return f"excess padding: {padding} '=' where the last group needs {needed}"
    if padding < needed:
        missing = "missing" if not padding else "incomplete"
        return (
            f"length {len(data)} is not a multiple of 4 ({missing} padding: "
            f"the last group needs {needed} '=')"
        )
    return ""


# Pillow's own words (as of Pillow 10-13) for a header it read but cannot represent: a TIFF's
# sample layout (photometric x sample format x bits per sample) missing from its table, more
# samples a pixel than any entry has; a JPEG of 12-bit samples or of 2 components. Anything
# else it refuses in the header is a damaged file.
_TIFF_UNSUPPORTED_PIXELS = ("unknown pixel mode", "Invalid value for samples per pixel")
_JPEG_UNSUPPORTED_PIXELS = "cannot handle "
# Compressions seen in the wild that Pillow's TIFF reader lacks, named in the error.
_TIFF_COMPRESSIONS = {
    33003: "Aperio JPEG 2000 (YCbCr)",
    33005: "Aperio JPEG 2000 (RGB)",
    34712: "JPEG 2000",
    34887: "LERC",
    34933: "PNG",
    34934: "JPEG XR",
    50002: "JPEG XL",
    52546: "JPEG XL",
}
_TIFF_PHOTOMETRIC: dict[object, str] = {
    0: "WhiteIsZero",
    1: "BlackIsZero",
    2: "RGB",
    3: "palette",
    4: "transparency mask",
    5: "CMYK",
    6: "YCbCr",
    8: "CIELab",
    9: "ICCLab",
    10: "ITULab",
}
_TIFF_SAMPLE_FORMATS: dict[object, str] = {
    1: "unsigned integer",
    2: "signed integer",
    3: "float",
    4: "untyped",
}


def unsupported_reason(format_name: str, raw: bytes, exc: Exception) -> str:
    """Why Pillow could not open ``raw``, when the reason is a pixel format or a compression it
    does not support (the image being otherwise well-formed); "" when it is damaged."""
    said = str(exc)
    if format_name == "PNG":  # Pillow says only "not identified by this driver"
        return _png_pixels(raw)
    if format_name == "JPEG" and said.startswith(_JPEG_UNSUPPORTED_PIXELS):
        return f"in a pixel format that is not supported ({said}; use 8-bit RGB)"
    # A bare number is the key of a KeyError Pillow met: an unknown compression, among others.
    if format_name != "TIFF" or not (said in _TIFF_UNSUPPORTED_PIXELS or said.isdigit()):
        return ""
    # Pillow read this IFD just now, before refusing its contents: reading it again costs as
    # much once more, on the error path only.
    tags = _tiff_first_ifd(raw)
    if tags is None:
        return ""
    compression = tags.get(TiffImagePlugin.COMPRESSION, 1)
    if isinstance(compression, int) and compression not in TiffImagePlugin.COMPRESSION_INFO:
        name = _TIFF_COMPRESSIONS.get(compression)
        return (
            "with a compression that is not supported "
            f"(compression {compression}{f', {name}' if name else ''})"
        )
    if said in _TIFF_UNSUPPORTED_PIXELS:
        return (
            f"in a pixel format that is not supported ({said}{_tiff_pixels(tags)}; use 8-bit RGB)"
        )
    return ""


#: the bit depths PNG allows for each colour type (PNG spec, table 11.1)
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}


def _png_pixels(raw: bytes) -> str:
    """A PNG's IHDR bit depth and colour type, named when PNG allows no such pair."""
    if raw[12:16] != b"IHDR" or len(raw) < 33:
        return ""  # no header where it belongs: damaged, not of a pixel format PNG lacks
    depth, colour = raw[24:25], raw[25:26]
    allowed = _PNG_DEPTHS.get(colour[0])
    if allowed is None:
        return f"of colour type {colour[0]}, which PNG does not have (0, 2, 3, 4 or 6)"
    if depth[0] not in allowed:
        shown = ", ".join(map(str, allowed))
        return f"of bit depth {depth[0]} for colour type {colour[0]} (PNG allows {shown})"
    return ""


def _tiff_first_ifd(raw: bytes) -> TiffImagePlugin.ImageFileDirectory_v2 | None:
    """The tags of a TIFF's first image, as Pillow reads them; None where they cannot be read."""
    try:
        fp = io.BytesIO(raw)
        header = fp.read(8)
        if header[2:3] == b"\x2b":  # BigTIFF: a 64-bit offset follows
            header += fp.read(8)
        tags = TiffImagePlugin.ImageFileDirectory_v2(header)
        fp.seek(tags.next)
        tags.load(fp)
    except Exception:
        return None
    return tags


def _tiff_pixels(tags: TiffImagePlugin.ImageFileDirectory_v2) -> str:
    """A TIFF's pixel layout in words, e.g. ": RGB, 3 samples of 32-bit float" ("" where the
    tags are too odd to describe)."""

    def values(value: object) -> tuple[object, ...]:
        return value if isinstance(value, tuple) else (value,)

    try:
        photometric = tags.get(TiffImagePlugin.PHOTOMETRIC_INTERPRETATION)
        bits = values(tags.get(TiffImagePlugin.BITSPERSAMPLE, 1))
        formats = values(tags.get(TiffImagePlugin.SAMPLEFORMAT, 1))
        samples = tags.get(TiffImagePlugin.SAMPLESPERPIXEL, len(bits))
        layout = _TIFF_PHOTOMETRIC.get(photometric, f"photometric {photometric}")
        width = "/".join(dict.fromkeys(str(b) for b in bits))
        kind = " and ".join(
            dict.fromkeys(_TIFF_SAMPLE_FORMATS.get(f, f"sample format {f}") for f in formats)
        )
        plural = "" if samples == 1 else "s"
    except Exception:  # pragma: no cover - a tag of an unhashable or odd type
        return ""
    return f": {layout}, {samples} sample{plural} of {width}-bit {kind}"


# Compressions Pillow hands to libtiff, whose build may lack them (Pillow's wheels have no WebP
# in libtiff): such a tile failed as "corrupt or truncated", though well-formed.
_LIBTIFF_OPTIONAL = {34925: "LZMA", 50000: "Zstandard", 50001: "WebP"}


def missing_tiff_codec(image: Image.Image) -> str:
    """Why a TIFF cannot be decoded here, if its compression is one this process's libtiff
    was built without (checked once a compression); "" otherwise."""
    if not isinstance(image, TiffImagePlugin.TiffImageFile):
        return ""
    compression = image.tag_v2.get(TiffImagePlugin.COMPRESSION)
    if compression not in _LIBTIFF_OPTIONAL or _libtiff_has(compression):
        return ""
    return (
        f"with a compression that is not supported (compression {compression}, "
        f"{_LIBTIFF_OPTIONAL[compression]}: this process's libtiff was built without it)"
    )


@cache
def _libtiff_has(compression: int) -> bool:
    """Whether libtiff here can write ``compression`` (its codecs are built for both ways)."""
    try:
        Image.new("RGB", (1, 1)).save(
            io.BytesIO(), format="TIFF", compression=TiffImagePlugin.COMPRESSION_INFO[compression]
        )
    except Exception:
        return False
    return True
