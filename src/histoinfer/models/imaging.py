"""Tile decoding: base64 -> PNG/JPEG/TIFF -> RGB -> resized ``uint8`` tensor ``[3, H, W]``.

Decoding stops at uint8 on purpose: normalization runs once per batch, on the device, in
:meth:`ServerModel.forward_batch`, which is cheaper than normalizing each tile on the CPU and
keeps this step's output four times smaller.
"""

from __future__ import annotations

import binascii
import io
import warnings

import torch
from PIL import Image

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
    try:
        raw = binascii.a2b_base64(image_data, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"not valid base64 ({exc})") from None
    if not raw:
        raise invalid("image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=sorted(ACCEPTED_FORMATS))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise invalid("image has too many pixels") from None
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
