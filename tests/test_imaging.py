"""Tile decoding: base64 -> PNG/JPEG/TIFF -> RGB -> resized uint8 tensor, or a clear error."""

from __future__ import annotations

import base64
import dataclasses
import io
import re
import struct
import sys
import threading
import warnings
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from helpers import tile_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from histoinfer.errors import InvalidRequestError
from histoinfer.models import faults, imaging, png
from histoinfer.models.faults import base64_fault
from histoinfer.models.imaging import decode_tile

WHERE = "for patch_idx=4 (slide 's', x=0, y=0)"


def decode(data: str | bytes, size: int = 32, tile: int = 32, **kw: Any) -> torch.Tensor:
    encoded = data if isinstance(data, str) else base64.b64encode(data).decode()
    args: dict[str, Any] = dict(
        width=size,
        height=size,
        tile_size=tile,
        interpolation="bilinear",
        max_image_bytes=1 << 20,
        max_image_pixels=1 << 20,
        where=WHERE,
    )
    args.update(kw)
    return decode_tile(encoded, **args)


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def pixels(raw: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB")).transpose(2, 0, 1)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_lossless_formats_decode_to_exact_pixels(fmt: str) -> None:
    raw = tile_bytes(1, size=32, fmt=fmt)
    tile = decode(raw)
    assert tile.dtype == torch.uint8 and tuple(tile.shape) == (3, 32, 32)
    assert np.array_equal(tile.numpy(), pixels(raw))


def test_jpeg_decodes_to_what_pillow_sees() -> None:
    raw = tile_bytes(2, size=32, fmt="JPEG")
    assert np.array_equal(decode(raw).numpy(), pixels(raw))


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_rgba_and_grayscale_become_rgb(mode: str) -> None:
    raw = tile_bytes(3, size=32, mode=mode)
    tile = decode(raw)
    assert tuple(tile.shape) == (3, 32, 32)
    assert np.array_equal(tile.numpy(), pixels(raw))
    if mode == "L":
        assert torch.equal(tile[0], tile[1]) and torch.equal(tile[1], tile[2])


def test_palette_images_become_rgb() -> None:
    rgb = Image.open(io.BytesIO(tile_bytes(4, size=32)))
    raw = encode(rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16))
    assert np.array_equal(decode(raw).numpy(), pixels(raw))


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest", "bicubic"])
def test_other_sizes_are_resized_with_the_models_interpolation(interpolation: str) -> None:
    raw = tile_bytes(5, size=16)
    tile = decode(raw, size=16, tile=32, interpolation=interpolation)
    resample = getattr(Image.Resampling, interpolation.upper())
    expected = Image.open(io.BytesIO(raw)).convert("RGB").resize((32, 32), resample)
    assert np.array_equal(tile.numpy(), np.asarray(expected).transpose(2, 0, 1))


def test_interpolation_matters() -> None:
    raw = tile_bytes(6, size=16)
    nearest = decode(raw, size=16, tile=32, interpolation="nearest")
    bilinear = decode(raw, size=16, tile=32, interpolation="bilinear")
    assert not torch.equal(nearest, bilinear)


def test_non_square_tiles_are_resized_to_the_square_tile() -> None:
    raw = encode(Image.new("RGB", (40, 20), (10, 20, 30)))
    tile = decode(raw, width=40, height=20, tile=32)
    assert tuple(tile.shape) == (3, 32, 32)
    assert tile[:, 5, 5].tolist() == [10, 20, 30]


# (name, image_data, decode kwargs, fragments the message must contain)
def bad_cases() -> list[tuple[str, str, dict[str, Any], list[str]]]:
    png = tile_bytes(7, size=32)
    b64 = base64.b64encode(png).decode()
    return [
        ("not base64", "***not base64***", {}, ["base64"]),
        ("base64 with junk", b64[:40] + "!" + b64[40:], {}, ["base64"]),
        ("data URL", "data:image/png;base64," + b64, {}, ["data:"]),
        ("empty", "", {}, ["empty"]),
        ("not an image", base64.b64encode(b"hello, world").decode(), {}, ["PNG, JPEG or TIFF"]),
        (
            "GIF",
            base64.b64encode(encode(Image.new("P", (32, 32)), "GIF")).decode(),
            {},
            ["GIF"],
        ),
        (
            "BMP",
            base64.b64encode(encode(Image.new("RGB", (32, 32)), "BMP")).decode(),
            {},
            ["(a BMP image)"],
        ),
        (
            "ICO",
            base64.b64encode(encode(Image.new("RGB", (32, 32)), "ICO")).decode(),
            {},
            ["(an ICO image)"],  # was "a ICO"
        ),
        (
            "PNG signature and garbage",  # not read as an impossible colour type (a review)
            base64.b64encode(png[:8] + bytes(range(40))).decode(),
            {},
            ["damaged or truncated PNG"],
        ),
        (
            "PNG of a bit depth PNG has not",
            base64.b64encode(png[:24] + b"\x07" + png[25:]).decode(),  # IHDR depth 8 -> 7
            {},
            ["a PNG image of bit depth 7 for colour type 2 (PNG allows 8, 16)"],
        ),
        ("truncated PNG", base64.b64encode(png[: len(png) // 2]).decode(), {}, ["truncated"]),
        (
            "PNG cut after its header",
            base64.b64encode(png[:40]).decode(),
            {},
            ["damaged or truncated PNG"],
        ),
        (
            "JPEG signature only",
            base64.b64encode(b"\xff\xd8\xff" + b"\0" * 20).decode(),
            {},
            ["JPEG"],
        ),
        (
            "TIFF signature only",
            base64.b64encode(b"II*\x00" + b"\0" * 20).decode(),
            {},
            ["damaged or truncated TIFF"],
        ),
        ("width mismatch", b64, {"width": 30}, ["30x32", "32x32", "'width'/'height'"]),
        ("height mismatch", b64, {"height": 64}, ["32x64", "32x32"]),
        ("too many pixels", b64, {"max_image_pixels": 32 * 31}, ["pixel"]),
        ("too many bytes", b64, {"max_image_bytes": len(png) // 2}, ["byte limit"]),
        (
            "float pixels",
            base64.b64encode(encode(Image.new("F", (32, 32)), "TIFF")).decode(),
            {},
            ["pixel mode 'F'"],
        ),
    ]


@pytest.mark.parametrize(
    ("name", "data", "kwargs", "fragments"), bad_cases(), ids=[c[0] for c in bad_cases()]
)
def test_bad_images_raise_invalid_request_naming_field_and_tile(
    name: str, data: str, kwargs: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode(data, **kwargs)
    message = str(info.value)
    assert WHERE in message, message
    for fragment in fragments:
        assert fragment in message, f"{name}: {fragment!r} not in {message!r}"
    # No object addresses: the same request must give the same message on every backend.
    assert not re.search(r"0x[0-9a-f]{6,}", message), message


def test_huge_declared_images_are_refused_before_decoding() -> None:
    # 6000x6000 of one colour compresses to almost nothing: the pixel limit must catch it.
    raw = encode(Image.new("L", (6000, 6000)))
    with pytest.raises(InvalidRequestError, match="6000x6000"):
        decode(raw, size=6000, max_image_pixels=4096 * 4096)


def test_concurrent_decoding_leaves_warning_filters_alone() -> None:
    # Regression: decode_tile used warnings.catch_warnings(), which is not thread-safe, and
    # concurrent decodes leaked an "error" filter for DecompressionBombWarning into the process.
    data = tile_bytes(8, size=32)
    before = list(warnings.filters)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as much as possible
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(150):
                decode(data)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert list(warnings.filters) == before


def test_decoded_tile_does_not_alias_between_calls() -> None:
    raw = tile_bytes(9, size=32)
    a, b = decode(raw), decode(raw)
    a.zero_()
    assert b.sum() > 0


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the corrupt metadata
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupted_images_decode_or_raise_invalid_request(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(["PNG", "JPEG", "TIFF"]))
    raw = bytearray(tile_bytes(10, size=16, fmt=fmt))
    for _ in range(data.draw(st.integers(1, 6))):
        position = data.draw(st.integers(0, len(raw) - 1))
        raw[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    try:
        tile = decode(bytes(raw[:cut]), size=16, tile=16)
    except InvalidRequestError as exc:
        assert WHERE in str(exc)
        return
    assert tile.dtype == torch.uint8 and tuple(tile.shape) == (3, 16, 16)


FAST_DECODERS = png.available_decoders()
if not FAST_DECODERS:  # pragma: no cover - the `fast` and `wuffs` extras are missing
    FAST_DECODERS = [pytest.param(None, marks=pytest.mark.skip("no fast PNG decoder installed"))]


def png_of(mode: str, size: int, seed: int, transparency: bool = False) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "P": 1}[mode]
    array = rng.integers(0, 256, (size, size, channels), dtype=np.uint8)
    image = Image.fromarray(array.squeeze(-1) if channels == 1 else array)
    if mode == "P":
        image = image.convert("P")
    options: dict[str, Any] = {}
    if transparency:  # a tRNS chunk: one colour (or palette entry) is transparent
        first = np.asarray(image)[0, 0]
        options["transparency"] = int(first) if first.ndim == 0 else tuple(int(v) for v in first)
    buf = io.BytesIO()
    image.save(buf, format="PNG", **options)
    return buf.getvalue()


def only_decoder(monkeypatch: pytest.MonkeyPatch, decoder: png.FastDecoder | None) -> list[int]:
    """Make ``decoder`` the only fast one (None: Pillow only); returns its call log."""
    calls: list[int] = []
    if decoder is None:
        monkeypatch.setattr(png, "DECODERS", [])
        return calls

    def counting(raw: bytes) -> np.ndarray:
        calls.append(len(raw))
        return decoder.decode(raw)

    monkeypatch.setattr(png, "DECODERS", [dataclasses.replace(decoder, decode=counting)])
    return calls


@pytest.mark.parametrize("decoder", FAST_DECODERS, ids=lambda d: getattr(d, "name", "none"))
@pytest.mark.parametrize(
    ("mode", "transparency"),
    [
        *[(mode, False) for mode in ("RGB", "RGBA", "L", "LA", "P")],
        *[(mode, True) for mode in ("RGB", "L", "P")],
    ],
)
@pytest.mark.parametrize("size", [224, 112])
def test_fast_png_decoders_are_pixel_identical_to_pillow(
    monkeypatch: pytest.MonkeyPatch,
    decoder: png.FastDecoder,
    mode: str,
    transparency: bool,
    size: int,
) -> None:
    """Every fast decoder gives exactly Pillow's pixels, resized or not, for what it takes;
    what it does not take falls back to Pillow instead of failing."""
    encoded = base64.b64encode(png_of(mode, size, size, transparency)).decode()
    kwargs: dict[str, Any] = dict(
        width=size,
        height=size,
        tile_size=224,
        interpolation="bilinear",
        max_image_bytes=1 << 25,
        max_image_pixels=1 << 24,
        where="for test",
    )
    calls = only_decoder(monkeypatch, decoder)
    fast = decode_tile(encoded, **kwargs)
    header = png.read_header(base64.b64decode(encoded))
    assert header is not None and header.transparency == transparency
    assert bool(calls) == decoder.takes(header)
    only_decoder(monkeypatch, None)
    slow = decode_tile(encoded, **kwargs)
    assert fast.shape == slow.shape == (3, 224, 224)
    assert torch.equal(fast, slow)


def test_the_fast_decoders_take_the_common_tile() -> None:
    """An opaque 8-bit RGB PNG (what tiles are) takes the fastest installed decoder."""
    if not png.DECODERS:  # pragma: no cover - the `fast` and `wuffs` extras are missing
        pytest.skip("no fast PNG decoder installed")
    header = png.read_header(png_of("RGB", 32, 0))
    assert header is not None and not header.transparency
    assert png.choose(header) is png.DECODERS[0]


@pytest.mark.parametrize("decoder", FAST_DECODERS, ids=lambda d: getattr(d, "name", "none"))
def test_fast_decoders_refuse_corrupt_pixel_data(
    monkeypatch: pytest.MonkeyPatch, decoder: png.FastDecoder
) -> None:
    """A flipped byte in the compressed pixels fails a checksum: the tile is refused, never
    decoded to wrong pixels (pywuffs skips the checks unless told)."""
    raw = png_of("RGB", 32, 3)
    calls = only_decoder(monkeypatch, decoder)
    refused = 0
    for position in range(50, len(raw) - 20, 97):  # inside IDAT, past the zlib header
        corrupt = bytearray(raw)
        corrupt[position] ^= 0x5A
        with pytest.raises(InvalidRequestError, match="image_data") as info:
            decode(bytes(corrupt))
        assert WHERE in str(info.value)
        refused += 1
    assert refused >= 10 and len(calls) == refused  # each went to the fast decoder first


def test_a_png_of_many_empty_chunks_is_read_in_bounded_time() -> None:
    """The tRNS scan stops after a bounded number of chunks, and the tile still decodes."""
    raw = png_of("RGB", 32, 5)
    empty_chunk = b"\x00\x00\x00\x00teXt\x00\x00\x00\x00"  # zero-length (CRC unchecked here)
    padded = raw[:33] + empty_chunk * 100_000 + raw[33:]
    header = png.read_header(padded)
    assert header is not None and header.transparency  # unknown: assumed present
    assert png.read_header(raw) == dataclasses.replace(header, transparency=False, palette=False)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def _palette_png(size: int, seed: int, plte: bool, trns: bytes | None) -> bytes:
    """A palette PNG written by hand: with or without its PLTE chunk, and a tRNS chunk."""
    indices = np.random.default_rng(seed).integers(0, 4, (size, size), dtype=np.uint8)
    rows = b"".join(b"\x00" + row.tobytes() for row in indices)
    ihdr = size.to_bytes(4, "big") * 2 + bytes([8, png.PALETTE, 0, 0, 0])
    chunks = [_chunk(b"IHDR", ihdr)]
    if plte:
        chunks.append(_chunk(b"PLTE", bytes([200, 10, 10, 10, 200, 10, 10, 10, 200, 90, 90, 90])))
    if trns is not None:
        chunks.append(_chunk(b"tRNS", trns))
    chunks += [_chunk(b"IDAT", zlib.compress(rows)), _chunk(b"IEND", b"")]
    return png.SIGNATURE + b"".join(chunks)


@pytest.mark.parametrize("decoder", FAST_DECODERS, ids=lambda d: getattr(d, "name", "none"))
@pytest.mark.parametrize("trns", [None, b"\xff\x80", b"\xff\x00"], ids=["none", "partial", "zero"])
def test_a_palette_png_without_its_palette_is_refused(
    monkeypatch: pytest.MonkeyPatch, decoder: png.FastDecoder | None, trns: bytes | None
) -> None:
    """Pillow makes up a palette for it (a wrong answer), or fails an internal assert."""
    only_decoder(monkeypatch, decoder)
    with pytest.raises(InvalidRequestError, match="palette PNG without its PLTE chunk") as info:
        decode(_palette_png(32, 1, plte=False, trns=trns))
    assert WHERE in str(info.value)


def test_a_palette_png_without_its_palette_behind_many_chunks_is_refused() -> None:
    """Past the header walk's bound (64 chunks before IDAT), Pillow's reading says it."""
    raw = _palette_png(32, 1, plte=False, trns=None)
    empty = _chunk(b"teXt", b"")
    padded = raw[:33] + empty * 100 + raw[33:]
    header = png.read_header(padded)
    assert header is not None and header.palette  # unknown: assumed present
    with pytest.raises(InvalidRequestError, match="palette"):
        decode(padded)


def test_a_palette_png_with_transparency_decodes_without_a_warning() -> None:
    raw = _palette_png(32, 2, plte=True, trns=bytes([255, 128, 200, 0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow warns converting it straight to RGB
        tile = decode(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.array_equal(tile.numpy(), pixels(raw))  # the same pixels as that conversion


def test_an_image_pillow_fails_to_convert_is_an_invalid_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def failing(self: Image.Image, *args: Any, **kwargs: Any) -> Image.Image:
        raise AssertionError  # as Pillow's own asserts on an inconsistent image

    monkeypatch.setattr(png, "DECODERS", [])
    monkeypatch.setattr(Image.Image, "convert", failing)
    with pytest.raises(InvalidRequestError, match=r"cannot be converted to RGB \(AssertionError"):
        decode(tile_bytes(3, size=32, mode="L"))


def _progressive_jpeg(extra_scans: int) -> bytes:
    """A progressive JPEG, with its last scan repeated ``extra_scans`` times (each repeat is a
    valid scan, and a pass over the whole image)."""
    raw = encode_jpeg(Image.new("L", (64, 64), 128), progressive=True)
    last = raw.rindex(b"\xff\xda")
    end = raw.rindex(b"\xff\xd9")
    return raw[:end] + raw[last:end] * extra_scans + raw[end:]


def encode_jpeg(image: Image.Image, **options: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", **options)
    return buf.getvalue()


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding() -> None:
    # a standard progressive JPEG, and one within the limit
    assert decode(_progressive_jpeg(0), size=64, tile=64).shape == (3, 64, 64)
    assert decode(_progressive_jpeg(50), size=64, tile=64).shape == (3, 64, 64)
    # Counted in the first image only: not in data after its end (a motion photo's video), nor
    # in a thumbnail (APP1), both full of the SOS marker's two bytes.
    baseline = encode_jpeg(Image.new("RGB", (64, 64), (200, 120, 160)))
    trailing = baseline + b"\xff\xda" * 500
    assert decode(trailing, size=64, tile=64).shape == (3, 64, 64)
    thumbnail = b"Exif\0\0" + b"\xff\xda" * 200
    app1 = b"\xff\xe1" + (len(thumbnail) + 2).to_bytes(2, "big") + thumbnail
    assert decode(baseline[:2] + app1 + baseline[2:], size=64, tile=64).shape == (3, 64, 64)
    # A JPEG-compressed TIFF (libtiff bounds its strips' scans itself): 128 strips of 8 rows.
    rgb = np.random.default_rng(0).integers(0, 256, (1024, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="TIFF", compression="jpeg", tiffinfo={278: 8})
    assert buf.getvalue().count(b"\xff\xda") > imaging.MAX_JPEG_SCANS
    assert decode(buf.getvalue(), width=64, height=1024).shape == (3, 32, 32)
    bomb = _progressive_jpeg(imaging.MAX_JPEG_SCANS)
    with pytest.raises(InvalidRequestError, match=r"a JPEG of over 100 scans"):
        decode(bomb, size=64)


def test_a_jpeg_header_that_would_cost_seconds_is_refused_before_pillow_reads_it() -> None:
    """Pillow's JPEG header parser is Python, a step per segment or stray byte: a trial's 7.5 M
    empty comments cost 11 s, 30 MB of bytes after a comment 3 s, and of fill bytes 19 s, each
    within every size limit, before anything was refused."""
    baseline = encode_jpeg(Image.new("RGB", (64, 64), (200, 120, 160)))
    comments = b"\xff\xfe\x00\x02" * 500  # 500 empty COM segments: odd, but cheap
    assert decode(baseline[:2] + comments + baseline[2:], size=64, tile=64).shape == (3, 64, 64)
    costly = {
        "a JPEG of over 1,000 segments": b"\xff\xfe\x00\x02" * 1001,
        "over 65,536 bytes between its segments": b"\xff\xfe\x00\x02" + b"\x00" * 70_000,
        "over 65,536 bytes between": b"\xff" * 70_000,  # fill bytes, stepped over alike
    }
    for says, inserted in costly.items():
        with pytest.raises(InvalidRequestError, match=says):
            decode(baseline[:2] + inserted + baseline[2:], size=64, max_image_bytes=1 << 21)


def _tiff_of_strips(height: int) -> bytes:
    """A 1 x ``height`` gray uncompressed TIFF, one strip a row (one byte each)."""
    entries = [(256, 4, 1, 1), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1)]
    entries += [(262, 3, 1, 1), (273, 4, height, 0), (278, 4, 1, 1), (279, 4, height, 0)]
    offsets_at = 8 + 2 + 12 * len(entries) + 4
    counts_at = offsets_at + 4 * height
    pixels_at = counts_at + 4 * height
    ifd = struct.pack("<H", len(entries))
    for tag, kind, count, value in entries:
        value = {273: offsets_at, 279: counts_at}.get(tag, value)
        ifd += struct.pack("<HHII", tag, kind, count, value)
    offsets = struct.pack(f"<{height}I", *range(pixels_at, pixels_at + height))
    counts = struct.pack(f"<{height}I", *([1] * height))
    gray = bytes(i % 256 for i in range(height))
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\0" * 4 + offsets + counts + gray


def test_a_tiff_of_too_many_strips_is_refused_before_pillow_sets_them_up() -> None:
    """2 M one-row strips of a 1-pixel wide TIFF (10.7 MB) cost a trial's server 20 s a request."""
    within = _tiff_of_strips(imaging.MAX_TIFF_STRIPS)
    assert decode(within, width=1, height=imaging.MAX_TIFF_STRIPS).shape == (3, 32, 32)
    with pytest.raises(InvalidRequestError, match=r"a TIFF of 8,193 strips \(at most 8,192"):
        decode(_tiff_of_strips(imaging.MAX_TIFF_STRIPS + 1), width=1, height=8193)
    # More where the pixel limit is higher: one a 256 pixels (a review: a 4096 x 4096 planar
    # TIFF of one-row strips has 12,288, and Pillow reads it in 0.16 s).
    over = _tiff_of_strips(imaging.MAX_TIFF_STRIPS + 1)
    assert decode(over, width=1, height=8193, max_image_pixels=4096 * 4096).shape == (3, 32, 32)


def test_an_mpo_of_too_many_scans_is_refused_as_a_jpeg() -> None:
    """Pillow opens a JPEG with an MPF header as an MPO: the same decoder, the same limit."""
    image = Image.new("RGB", (64, 64), (200, 120, 160))
    buf = io.BytesIO()
    image.save(buf, "MPO", save_all=True, append_images=[image], progressive=True)
    mpo = buf.getvalue()
    with Image.open(io.BytesIO(mpo)) as opened:
        assert opened.format == "MPO"
    assert decode(mpo, size=64, tile=64).shape == (3, 64, 64)
    end = mpo.index(b"\xff\xd9")  # the first frame's last scan, repeated
    last = mpo.rindex(b"\xff\xda", 0, end)
    crafted = mpo[:end] + mpo[last:end] * imaging.MAX_JPEG_SCANS + mpo[end:]
    with pytest.raises(InvalidRequestError, match=r"a JPEG of over 100 scans"):
        decode(crafted, size=64)


@pytest.mark.parametrize("mode", ["RGB", "I;16"])  # a fast decoder's PNG, and one only Pillow reads
def test_a_png_declaring_too_many_pixels_is_refused_from_its_header(mode: str) -> None:
    raw = bytearray(encode(Image.new(mode, (32, 32))))
    raw[16:24] = (20_000).to_bytes(4, "big") * 2  # IHDR width and height: 400 M pixels
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning must not even fire
        with pytest.raises(InvalidRequestError, match="20000x20000, over the"):
            decode(bytes(raw))


def _jpeg_declaring(width: int, height: int) -> bytes:
    raw = bytearray(encode(Image.new("RGB", (32, 32)), "JPEG"))
    sof = raw.index(b"\xff\xc0")  # baseline SOF0: length(2), precision(1), height(2), width(2)
    raw[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(raw)


def _tiff_declaring(width: int, height: int) -> bytes:
    raw = bytearray(encode(Image.new("RGB", (32, 32)), "TIFF"))
    assert raw[:2] == b"II"  # little-endian, as Pillow writes it
    ifd = int.from_bytes(raw[4:8], "little")
    for i in range(int.from_bytes(raw[ifd : ifd + 2], "little")):
        entry = ifd + 2 + 12 * i
        tag, kind = (int.from_bytes(raw[entry + k : entry + k + 2], "little") for k in (0, 2))
        if tag in (256, 257):  # ImageWidth, ImageLength; SHORT (3) or LONG (4)
            value = width if tag == 256 else height
            raw[entry + 8 : entry + 12] = value.to_bytes(2 if kind == 3 else 4, "little").ljust(
                4, b"\0"
            )
    return bytes(raw)


@pytest.mark.parametrize("declaring", [_jpeg_declaring, _tiff_declaring], ids=["JPEG", "TIFF"])
def test_a_jpeg_or_tiff_declaring_too_many_pixels_is_refused_without_pillows_warning(
    declaring: Any,
) -> None:
    """Over Pillow's ~89 M-pixel bomb threshold: our limit's error, and no warning first."""
    raw = declaring(10_000, 10_000)  # 100 M pixels
    with pytest.warns(Image.DecompressionBombWarning), Image.open(io.BytesIO(raw)) as image:
        assert image.size == (10_000, 10_000)  # the header does declare it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InvalidRequestError, match="10000x10000, over the"):
            decode(raw)
    assert decode(declaring(32, 32)).shape == (3, 32, 32)  # the same file, honest, decodes


@pytest.mark.parametrize(
    "data",
    [
        *("QUJD", "QUI=", "QQ==", "", "QUI", "QUI==", "QUI===", "QUJD=", "QUJD==", "QUJD===="),
        *("QQ=Q", "QUI=QUI=", "QU JD", "QUJ!"),
    ],
)
def test_base64_is_valid_or_not_whichever_decoder_is_installed(data: str) -> None:
    """pybase64 (the `fast` extra) and the standard library's fallback agree on every body."""
    pybase64 = pytest.importorskip("pybase64")
    from histoinfer.models.imaging import _b64decode_stdlib

    def outcome(decode: Any) -> object:
        try:
            return decode(data)
        except ValueError:  # binascii.Error too
            return "refused"

    assert outcome(_b64decode_stdlib) == outcome(lambda d: pybase64.b64decode(d, validate=True)), (
        data
    )


def _tiff(
    *,
    photometric: int = 2,
    samples: int = 3,
    bits: int = 8,
    sample_format: int = 1,
    compression: int = 1,
    size: int = 32,
) -> bytes:
    """A minimal, well-formed little-endian TIFF of one strip of zero samples, as the tags say."""
    data = bytes(size * size * samples * bits // 8)
    entries = [  # (tag, type: 3 SHORT or 4 LONG, values)
        (256, 4, [size]),  # ImageWidth
        (257, 4, [size]),  # ImageLength
        (258, 3, [bits] * samples),  # BitsPerSample
        (259, 3, [compression]),
        (262, 3, [photometric]),
        (273, 4, [0]),  # StripOffsets: set below
        (277, 3, [samples]),  # SamplesPerPixel
        (278, 4, [size]),  # RowsPerStrip
        (279, 4, [len(data)]),  # StripByteCounts
        (284, 3, [1]),  # PlanarConfiguration: contiguous
        (339, 3, [sample_format] * samples),  # SampleFormat
    ]
    packed = [
        (tag, kind, b"".join(v.to_bytes(2 if kind == 3 else 4, "little") for v in values))
        for tag, kind, values in entries
    ]
    out_of_line = 8 + 2 + 12 * len(entries) + 4  # after the header and the IFD
    strip = out_of_line + sum(len(payload) for *_, payload in packed if len(payload) > 4)
    ifd, extra = bytearray(len(entries).to_bytes(2, "little")), bytearray()
    for tag, kind, payload in packed:
        count = len(payload) // (2 if kind == 3 else 4)
        if tag == 273:
            payload = strip.to_bytes(4, "little")
        if len(payload) > 4:
            value = (out_of_line + len(extra)).to_bytes(4, "little")
            extra += payload
        else:
            value = payload.ljust(4, b"\0")
        ifd += tag.to_bytes(2, "little") + kind.to_bytes(2, "little")
        ifd += count.to_bytes(4, "little") + value
    ifd += bytes(4)  # no next IFD
    return b"II*\0" + (8).to_bytes(4, "little") + bytes(ifd) + bytes(extra) + data


def test_the_minimal_tiff_writer_writes_readable_tiffs() -> None:
    assert decode(_tiff()).sum() == 0  # 8-bit RGB
    assert decode(_tiff(photometric=1, samples=1)).sum() == 0  # 8-bit gray


@pytest.mark.parametrize(
    ("tags", "described"),
    [
        ({"bits": 32, "sample_format": 3}, "RGB, 3 samples of 32-bit float"),
        ({"bits": 16, "sample_format": 3}, "RGB, 3 samples of 16-bit float"),
        ({"sample_format": 2}, "RGB, 3 samples of 8-bit signed integer"),
        ({"bits": 32}, "RGB, 3 samples of 32-bit unsigned integer"),
        ({"photometric": 1, "samples": 5}, "BlackIsZero, 5 samples of 8-bit unsigned integer"),
    ],
    ids=["float32 RGB", "float16 RGB", "int8 RGB", "uint32 RGB", "5 samples"],
)
def test_a_tiff_in_a_pixel_format_pillow_cannot_read_is_unsupported_not_damaged(
    tags: dict[str, int], described: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode(_tiff(**tags))
    assert str(info.value) == (
        f"invalid request {WHERE}: field 'image_data': a TIFF image in a pixel format that is "
        f"not supported (unknown pixel mode: {described}; use 8-bit RGB)"
    )


@pytest.mark.parametrize(
    ("compression", "named"),
    [
        (34712, "compression 34712, JPEG 2000"),
        (33005, "compression 33005, Aperio JPEG 2000 (RGB)"),
        (60000, "compression 60000"),
    ],
    ids=["JPEG 2000", "Aperio JPEG 2000", "unknown"],
)
def test_a_tiff_in_a_compression_pillow_cannot_read_is_unsupported_not_damaged(
    compression: int, named: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        decode(_tiff(compression=compression))
    assert str(info.value) == (
        f"invalid request {WHERE}: field 'image_data': a TIFF image with a compression that is "
        f"not supported ({named})"
    )


@pytest.mark.parametrize("has_it", [False, True], ids=["libtiff without WebP", "with WebP"])
def test_a_tiff_in_a_compression_libtiff_was_built_without_is_unsupported_not_corrupt(
    has_it: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow's wheels link a libtiff without WebP: a WebP-compressed TIFF (common from slide
    converters) was "corrupt or truncated", with libtiff's own complaint on stderr."""
    monkeypatch.setattr(faults, "_libtiff_has", lambda compression: has_it)
    with pytest.raises(InvalidRequestError) as info:
        decode(_tiff(compression=50001))  # its strip is raw bytes: no WebP stream
    said = str(info.value)
    if has_it:
        assert "image data is corrupt or truncated" in said
    else:
        assert said == (
            f"invalid request {WHERE}: field 'image_data': a TIFF image with a compression that "
            "is not supported (compression 50001, WebP: this process's libtiff was built "
            "without it)"
        )


def test_which_compressions_libtiff_has_is_asked_of_libtiff() -> None:
    # Pillow does not say which codecs its libtiff has; writing a pixel with one tells.
    assert faults._libtiff_has(5) and faults._libtiff_has(8)  # LZW, Deflate: always built in


def test_a_damaged_tiff_is_still_damaged() -> None:
    # A palette image without its ColorMap: Pillow's KeyError is a bare number, as for an unknown
    # compression, but this one is a broken file.
    with pytest.raises(InvalidRequestError, match="a damaged or truncated TIFF image"):
        decode(_tiff(photometric=3, samples=1))


def test_a_12_bit_jpeg_is_unsupported_not_damaged() -> None:
    raw = bytearray(encode(Image.new("RGB", (32, 32)), "JPEG"))
    sof = raw.index(b"\xff\xc0")  # baseline SOF0: length(2), precision(1), ...
    raw[sof + 4] = 12
    with pytest.raises(InvalidRequestError) as info:
        decode(bytes(raw))
    assert str(info.value) == (
        f"invalid request {WHERE}: field 'image_data': a JPEG image in a pixel format that is "
        "not supported (cannot handle 12-bit layers; use 8-bit RGB)"
    )


try:
    import pybase64
except ImportError:  # pragma: no cover - the `fast` extra is missing
    pybase64 = None


def _pybase64_decode(data: str) -> bytes:
    return bytes(pybase64.b64decode(data, validate=True))


BASE64_DECODERS = [
    pytest.param(imaging._b64decode_stdlib, id="stdlib"),
    pytest.param(
        _pybase64_decode,
        id="pybase64",
        marks=pytest.mark.skipif(pybase64 is None, reason="pybase64 is not installed"),
    ),
]
NO_SPACES = "(send the base64 without spaces or line breaks)"


@pytest.mark.parametrize("decoder", BASE64_DECODERS)
@pytest.mark.parametrize(
    ("data", "fault"),
    [
        ("YWJjZA", "length 6 is not a multiple of 4 (missing padding: the last group needs 2 '=')"),
        (
            "YWJjZGU",
            "length 7 is not a multiple of 4 (missing padding: the last group needs 1 '=')",
        ),
        (
            "YWJjZA=",
            "length 7 is not a multiple of 4 (incomplete padding: the last group needs 2 '=')",
        ),
        (" YWJj", f"character ' ' at offset 0 is not in the base64 alphabet {NO_SPACES}"),
        (" QQ==", f"character ' ' at offset 0 is not in the base64 alphabet {NO_SPACES}"),
        ("YWJj\nYWJj", f"character '\\n' at offset 4 is not in the base64 alphabet {NO_SPACES}"),
        ("QQ==\r\n", f"character '\\r' at offset 4 is not in the base64 alphabet {NO_SPACES}"),
        (
            "YWJj-_8=",
            "character '-' at offset 4 is not in the base64 alphabet "
            "(URL-safe base64? send the standard alphabet, with '+' and '/')",
        ),
        ("YWJj!", "character '!' at offset 4 is not in the base64 alphabet"),
        ("YWJjé", "character 'é' at offset 4 is not in the base64 alphabet"),
        ("YWJj\x00", "character '\\x00' at offset 4 is not in the base64 alphabet"),
        ("QQ==QQ==", "padding '=' in the middle of the data, at offset 2"),
        ("YWJj=", "excess padding: 1 '=' after a complete group of 4 characters"),
        ("====", "excess padding: 4 '=' after a complete group of 4 characters"),
        ("YWI==", "excess padding: 2 '=' where the last group needs 1"),
        (
            "YWJjZ",
            "length 5: the last group has a single character, which encodes nothing "
            "(the data is truncated, or has a character too many)",
        ),
        (
            "YWJjZ===",
            "length 8: the last group has a single character, which encodes nothing "
            "(the data is truncated, or has a character too many)",
        ),
    ],
    ids=[
        "missing padding 2",
        "missing padding 1",
        "incomplete padding",
        "leading space",
        "leading space before padding",
        "newline",
        "CRLF",
        "URL-safe",
        "punctuation",
        "non-ASCII",
        "NUL",
        "padding in the middle",
        "padding after a full group",
        "padding only",
        "too much padding",
        "a lone last character",
        "a lone last character padded",
    ],
)
def test_base64_faults_are_named_in_one_wording_whichever_decoder_refuses(
    monkeypatch: pytest.MonkeyPatch, decoder: Any, data: str, fault: str
) -> None:
    monkeypatch.setattr(imaging, "_b64decode", decoder)
    with pytest.raises(InvalidRequestError) as info:
        decode(data)
    assert str(info.value) == (
        f"invalid request {WHERE}: field 'image_data': not valid base64: {fault}"
    )


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="AQgw+/=-_ \n!é", max_size=10))
def test_a_base64_fault_is_named_exactly_when_a_decoder_refuses(data: str) -> None:
    for decoder in (imaging._b64decode_stdlib, *([_pybase64_decode] if pybase64 else [])):
        try:
            decoder(data)
        except ValueError:  # binascii.Error too
            assert base64_fault(data), (decoder, data)
        else:
            assert base64_fault(data) == "", (decoder, data)


@pytest.mark.parametrize("decoder", BASE64_DECODERS)
def test_valid_base64_still_decodes_with_either_decoder(
    monkeypatch: pytest.MonkeyPatch, decoder: Any
) -> None:
    monkeypatch.setattr(imaging, "_b64decode", decoder)
    raw = tile_bytes(11, size=32)
    assert np.array_equal(decode(base64.b64encode(raw).decode()).numpy(), pixels(raw))


def test_a_tile_that_is_not_square_is_stretched_and_said_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A slide's edge tile, cut short, was resized to a square with no word (a user trial)."""
    monkeypatch.setattr(imaging, "_stretched_said", False)
    edge = encode(Image.new("RGB", (32, 16), (200, 120, 160)))
    with caplog.at_level("WARNING", logger="histoinfer.tiles"):
        for _ in range(2):
            assert decode(edge, width=32, height=16).shape == (3, 32, 32)
        assert decode(encode(Image.new("RGB", (32, 32))), size=32).shape == (3, 32, 32)
    [said] = [r.getMessage() for r in caplog.records if r.name == "histoinfer.tiles"]
    assert said.startswith("a 32x16 tile (patch_idx=4 (slide 's', x=0, y=0)) is resized to 32x32")


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grayscale_is_converted_by_its_high_byte(fmt: str) -> None:
    """SPEC §3.1: grayscale is converted to RGB. A 16-bit one (Pillow's ``I;16``) was refused
    ("pixel mode 'I;16' is not supported"), and Pillow's own conversion clips at 255 (every
    pixel white): its high byte, as Pillow reads a 16-bit RGB PNG."""
    wide = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, format=fmt)
    assert Image.open(io.BytesIO(buf.getvalue())).mode == "I;16"
    tile = decode(buf.getvalue())
    expected = torch.from_numpy((wide >> 8).astype(np.uint8))
    assert all(torch.equal(tile[channel], expected) for channel in range(3))


def test_big_endian_16_bit_grayscale_too_and_32_bit_stays_refused() -> None:
    """A big-endian 16-bit TIFF reads alike; a 32-bit one (``I``) would be clipped by a high
    byte of 16 bits, so it is refused, as before (a review)."""
    wide = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)
    big = Image.frombytes("I;16B", (32, 32), wide.astype(">u2").tobytes())
    tile = decode(encode(big, "TIFF"))
    assert torch.equal(tile[0], torch.from_numpy((wide >> 8).astype(np.uint8)))
    wider = Image.fromarray(np.full((32, 32), 70_000, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="pixel mode 'I' is not supported"):
        decode(encode(wider, "TIFF"))
