"""The fast PNG decoders with libdeflate in front (models/png.py, ``_Inflated``): they give
Pillow's pixels and refuse everything the strict decoders refuse, because they check the
checksums themselves before handing over the pixel data stored uncompressed."""

from __future__ import annotations

import base64
import dataclasses
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from histoinfer.models import png
from histoinfer.models.imaging import decode_tile

INFLATED = [d for d in png.available_decoders() if d.name.startswith("libdeflate")]
if not INFLATED:  # pragma: no cover - the `fast` extra is missing
    INFLATED = [pytest.param(None, marks=pytest.mark.skip("imagecodecs is not installed"))]
by_name = pytest.mark.parametrize("decoder", INFLATED, ids=lambda d: getattr(d, "name", "none"))


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def chunks(raw: bytes) -> list[tuple[bytes, bytes]]:
    found, position = [], 8
    while position < len(raw):
        (length,) = struct.unpack_from(">I", raw, position)
        found.append((raw[position + 4 : position + 8], raw[position + 8 : position + 8 + length]))
        position += 12 + length
    return found


def assemble(parts: list[tuple[bytes, bytes]]) -> bytes:
    return png.SIGNATURE + b"".join(chunk(kind, data) for kind, data in parts)


def tile_png(mode: str = "RGB", size: int = 96, seed: int = 0) -> bytes:
    """A noisy tile (several IDAT chunks at 224 px), in Pillow's adaptive filtering."""
    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    # smooth plus noise: every PNG filter type gets used somewhere
    base = np.linspace(0, 200, size * size).reshape(size, size)
    noise = rng.integers(0, 56, shape)
    array = ((base[..., None] if mode == "RGB" else base) + noise).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def pillow_rgb(raw: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB"))


@by_name
@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("size", [1, 7, 224, 300])
def test_inflated_decoders_give_pillows_pixels(
    decoder: png.FastDecoder, mode: str, size: int
) -> None:
    """300 px RGB is 270,300 bytes of scanlines: five stored blocks, the last one short."""
    raw = tile_png(mode, size, seed=size)
    header = png.read_header(raw)
    assert header is not None and decoder.takes(header)
    assert np.array_equal(decoder.decode(raw), pillow_rgb(raw))


def test_the_common_tile_is_inflated_by_libdeflate_first() -> None:
    if not INFLATED or not isinstance(INFLATED[0], png.FastDecoder):
        pytest.skip("imagecodecs is not installed")
    header = png.read_header(tile_png())
    assert header is not None
    chosen = png.choose(header)
    assert chosen is not None and chosen.name.startswith("libdeflate")


@by_name
def test_pixel_data_whose_only_fault_is_its_adler32_is_refused(decoder: png.FastDecoder) -> None:
    """A valid deflate stream of other pixels, with the original Adler-32 and every CRC-32
    right: only the Adler-32 can tell, and the decoder behind is told to skip it."""
    parts = chunks(tile_png())
    stream = b"".join(data for kind, data in parts if kind == b"IDAT")
    rows = bytearray(zlib.decompress(stream))
    rows[1000] ^= 0x40
    forged = zlib.compress(bytes(rows))[:-4] + stream[-4:]
    raw = assemble([parts[0], (b"IDAT", forged), (b"IEND", b"")])
    assert np.array_equal(decoder.decode(assemble(parts)), pillow_rgb(assemble(parts)))
    with pytest.raises(Exception, match="BAD_DATA"):
        decoder.decode(raw)


@by_name
@pytest.mark.parametrize("where", ["IHDR", "IDAT", "teXt before", "teXt after", "IEND"])
def test_a_bad_crc32_in_any_chunk_is_refused(decoder: png.FastDecoder, where: str) -> None:
    parts = chunks(tile_png())
    text = (b"teXt", b"Comment\x00a tile")
    parts = [parts[0], text, *parts[1:-1], text, parts[-1]]
    raw = bytearray(assemble(parts))
    index = {"IHDR": 0, "teXt before": 1, "IDAT": 2, "teXt after": -2, "IEND": -1}[where]
    position = 8 + sum(12 + len(data) for _, data in parts[:index])
    if index < 0:
        position = 8 + sum(12 + len(data) for _, data in parts[: len(parts) + index])
    crc_at = position + 8 + len(parts[index][1])
    assert parts[index][0] in (b"IHDR", b"IDAT", b"teXt", b"IEND")
    decoder.decode(bytes(raw))  # intact: decodes
    raw[crc_at] ^= 0x01
    with pytest.raises(ValueError, match="bad CRC-32"):
        decoder.decode(bytes(raw))


@by_name
@pytest.mark.parametrize("extra", [-1, 1, 300])
def test_pixel_data_of_the_wrong_length_is_refused(decoder: png.FastDecoder, extra: int) -> None:
    parts = chunks(tile_png(size=32))
    rows = zlib.decompress(b"".join(data for kind, data in parts if kind == b"IDAT"))
    rows = rows[:extra] if extra < 0 else rows + bytes(extra)
    raw = assemble([parts[0], (b"IDAT", zlib.compress(rows)), (b"IEND", b"")])
    with pytest.raises(Exception):  # noqa: B017 - libdeflate's own error, or ours
        decoder.decode(raw)


@by_name
def test_an_ihdr_of_another_length_is_refused(decoder: png.FastDecoder) -> None:
    """The stored PNG copies the first 33 bytes as the header: they must be exactly it."""
    parts = chunks(tile_png(size=32))
    raw = assemble([(b"IHDR", parts[0][1] + b"\x00"), *parts[1:]])  # 14 bytes, CRC right
    with pytest.raises(ValueError, match="not 13 bytes"):
        decoder.decode(raw)


@by_name
def test_idat_chunks_separated_by_another_chunk_are_left_to_pillow(
    decoder: png.FastDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PNG wants its IDAT chunks consecutive; such a file gets Pillow's answer, whatever it is."""
    parts = chunks(tile_png(size=224))
    idats = [i for i, (kind, _) in enumerate(parts) if kind == b"IDAT"]
    assert len(idats) >= 2  # Pillow splits 224 px of noise over several
    split = [*parts[: idats[1]], (b"teXt", b"Comment\x00between"), *parts[idats[1] :]]
    raw = assemble(split)
    with pytest.raises(ValueError, match="IDAT chunks separated"):
        decoder.decode(raw)
    decoder.decode(assemble(parts))  # consecutive: decodes


@by_name
def test_a_png_of_too_many_chunks_after_its_pixels_is_left_to_pillow(
    decoder: png.FastDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk walk is bounded; decode_tile then falls back to Pillow's pixels."""
    parts = chunks(tile_png(size=16))
    many = parts[:-1] + [(b"prVt", b"")] * 2000 + parts[-1:]
    raw = assemble(many)
    with pytest.raises(ValueError, match="more than 1024 chunks"):
        decoder.decode(raw)
    monkeypatch.setattr(png, "DECODERS", [decoder])
    tile = decode_tile(
        base64.b64encode(raw).decode(),
        width=16,
        height=16,
        tile_size=16,
        interpolation="bilinear",
        max_image_bytes=1 << 25,
        max_image_pixels=1 << 24,
        where="for test",
    )
    assert np.array_equal(tile.permute(1, 2, 0).numpy(), pillow_rgb(raw))


def test_interlaced_transparent_16_bit_and_palette_pngs_are_not_inflated_up_front() -> None:
    common = png.read_header(tile_png())
    assert common is not None and png._Inflated.takes(common)
    ihdr = bytearray(chunks(tile_png())[0][1])
    ihdr[12] = 1  # Adam7
    interlaced = png.read_header(assemble([(b"IHDR", bytes(ihdr)), (b"IEND", b"")]))
    assert interlaced is not None and interlaced.interlaced
    assert not png._Inflated.takes(interlaced)
    for other in (
        dataclasses.replace(common, transparency=True),
        dataclasses.replace(common, depth=16),
        dataclasses.replace(common, color_type=3),
        dataclasses.replace(common, color_type=6),
    ):
        assert not png._Inflated.takes(other)
