"""Tile decoding: base64 -> PNG/JPEG/TIFF -> RGB -> resized ``uint8`` tensor ``[3, H, W]``.

Decoding stops at uint8 on purpose: normalization runs once per batch, on the device, in
:meth:`ServerModel.forward_batch`, which is cheaper than normalizing each tile on the CPU and
keeps this step's output four times smaller.
"""

from __future__ import annotations

import binascii
import io

import torch
from PIL import Image, UnidentifiedImageError

from ..errors import InvalidRequestError

__all__ = ["ACCEPTED_FORMATS", "decode_tile"]

ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "TIFF"})
# Pixel modes that convert to RGB without losing meaning (16-bit and float modes would clip).
_CONVERTIBLE_MODES = frozenset({"RGB", "RGBA", "RGBX", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1"})

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


def _unaccepted_format(raw: bytes) -> str:
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WebP"
    if raw[4:12] in (b"ftypavif", b"ftypheic", b"ftypmif1"):
        return "AVIF/HEIF"
    return next((name for magic, name in _OTHER_FORMATS if raw.startswith(magic)), "")


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
        raw = binascii.a2b_base64(image_data, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"not valid base64 ({exc})") from None
    if not raw:
        raise invalid("image is empty")
    try:
        # No warnings.catch_warnings() here: it is not thread-safe, and tiles are decoded on
        # many threads at once (it leaked an "error" filter into the process). Our own pixel
        # limit sits below Pillow's bomb threshold, so its warning never matters to us.
        image = Image.open(io.BytesIO(raw), formats=sorted(ACCEPTED_FORMATS))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise invalid("image has too many pixels") from None
    except UnidentifiedImageError:
        other = _unaccepted_format(raw)
        sent = f"a {other} image" if other else "an unrecognized format"
        raise invalid(f"not a PNG, JPEG or TIFF image ({sent})") from None
    except Exception as exc:
        raise invalid(
            f"not a decodable PNG, JPEG or TIFF image ({type(exc).__name__}: {exc})"
        ) from None
    with image:
        if image.width * image.height > max_image_pixels:
            raise invalid(
                f"image is {image.width}x{image.height}, over the {max_image_pixels}-pixel limit"
            )
        if (image.width, image.height) != (width, height):
            raise InvalidRequestError(
                f"invalid request {where}: fields 'width'/'height' say {width}x{height} "
                f"but the decoded image is {image.width}x{image.height}"
            )
        if image.mode not in _CONVERTIBLE_MODES:
            raise invalid(f"pixel mode {image.mode!r} is not supported (use 8-bit RGB)")
        try:
            image.load()
        except Exception as exc:
            raise invalid(
                f"image data is corrupt or truncated ({type(exc).__name__}: {exc})"
            ) from None
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        if rgb.size != (tile_size, tile_size):
            rgb = rgb.resize((tile_size, tile_size), _RESAMPLE[interpolation])
        pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return pixels.view(tile_size, tile_size, 3).permute(2, 0, 1)
