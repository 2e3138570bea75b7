"""``histoinfer.tile_body``: tiles in memory (PIL, numpy) to request bodies, alpha composited."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from PIL import Image

from histoinfer import tile_body
from histoinfer.clients.inprocess import InProcessClient
from histoinfer.models import ServerModel
from histoinfer.schema import ModelRequest, parse_request

FIELDS: dict[str, Any] = {"slide_name": "S1", "x": 448, "y": 224, "patch_idx": 7}


def pixels(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def decoded(body: str) -> tuple[ModelRequest, np.ndarray]:
    """The parsed request and its image's pixels, checked to be an RGB PNG of the stated size."""
    request = parse_request(body)
    image = Image.open(io.BytesIO(base64.b64decode(request.image_data, validate=True)))
    assert image.format == "PNG"
    assert image.mode == "RGB"
    assert image.size == (request.width, request.height)
    return request, np.asarray(image)


def rgb_png_body(rgb: np.ndarray) -> str:
    """A body built by hand (not by ``tile_body``), as the README used to."""
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, format="PNG")
    height, width = rgb.shape[:2]
    return json.dumps(
        {
            "image_data": base64.b64encode(png.getvalue()).decode(),
            "width": width,
            "height": height,
            **FIELDS,
        }
    )


# ---- accepted inputs round-trip exactly -------------------------------------------------------


def test_numpy_rgb_round_trips_with_its_fields():
    tile = pixels(0, (17, 23, 3))  # not square: width and height must not be swapped
    body = tile_body(tile, **FIELDS, tissue_ratio=0.75, resolution=0.5)
    request, got = decoded(body)
    np.testing.assert_array_equal(got, tile)
    assert (request.width, request.height) == (23, 17)
    assert (request.slide_name, request.x, request.y, request.patch_idx) == ("S1", 448, 224, 7)
    assert (request.tissue_ratio, request.resolution) == (0.75, 0.5)


def test_optional_fields_are_left_out_when_not_given():
    raw = json.loads(tile_body(pixels(1, (8, 8, 3)), **FIELDS))
    assert "tissue_ratio" not in raw
    assert "resolution" not in raw
    assert set(raw) == {"image_data", "slide_name", "x", "y", "width", "height", "patch_idx"}


def test_a_strided_view_round_trips():
    region = pixels(2, (64, 80, 3))
    for view in (region[5:37, 11:43], region[:, ::-1], region[::2, ::3]):
        _, got = decoded(tile_body(view, **FIELDS))
        np.testing.assert_array_equal(got, view)


def test_numpy_grayscale_becomes_rgb():
    tile = pixels(3, (12, 9))
    _, got = decoded(tile_body(tile, **FIELDS))
    assert got.shape == (12, 9, 3)
    for channel in range(3):
        np.testing.assert_array_equal(got[:, :, channel], tile)
    # with a channel axis of one, as array code often leaves it: the same tile
    assert tile_body(tile[:, :, None], **FIELDS) == tile_body(tile, **FIELDS)


def test_numpy_opaque_rgba_keeps_its_colours():
    tile = pixels(4, (10, 14, 4))
    tile[:, :, 3] = 255
    _, got = decoded(tile_body(tile, **FIELDS))
    np.testing.assert_array_equal(got, tile[:, :, :3])


@pytest.mark.parametrize("mode", ["RGB", "L", "P", "1", "CMYK", "RGBX", "YCbCr"])
def test_pil_images_without_alpha_round_trip(mode: str):
    source = Image.fromarray(pixels(5, (13, 21, 3)))
    image = source.quantize(64) if mode == "P" else source.convert(mode)
    request, got = decoded(tile_body(image, **FIELDS))
    assert (request.width, request.height) == (21, 13)
    np.testing.assert_array_equal(got, np.asarray(image.convert("RGB")))
    if mode == "RGB":
        np.testing.assert_array_equal(got, np.asarray(source))


def test_pil_and_numpy_give_the_same_body():
    tile = pixels(6, (16, 16, 4))
    tile[:8, :, 3] = 0
    tile[8:, :, 3] = 200
    from_numpy = tile_body(tile, **FIELDS)
    assert tile_body(Image.fromarray(tile), **FIELDS) == from_numpy


def test_numpy_integer_fields_become_json_ints():
    raw = json.loads(
        tile_body(
            pixels(7, (4, 4, 3)),
            slide_name="S1",
            x=np.int64(3),
            y=np.uint32(5),
            patch_idx=np.int16(2),
            tissue_ratio=np.float32(0.25),
            resolution=np.float64(0.5),
        )
    )
    assert (raw["x"], raw["y"], raw["patch_idx"]) == (3, 5, 2)
    assert (raw["tissue_ratio"], raw["resolution"]) == (0.25, 0.5)
    assert type(raw["x"]) is int
    parse_request(json.dumps(raw))


def test_a_float32_field_is_sent_as_the_number_it_shows():
    """np.float32(0.3) widened to a double is 0.30000001192092896, echoed so in every response
    (a slide-workflow trial); its own shortest digits are what the caller meant."""
    raw = json.loads(
        tile_body(
            pixels(7, (4, 4, 3)),
            **FIELDS,
            tissue_ratio=np.float32(0.3),
            resolution=np.float16(0.25),
        )
    )
    assert (raw["tissue_ratio"], raw["resolution"]) == (0.3, 0.25)


# ---- transparency ----------------------------------------------------------------------------


def openslide_like(seed: int = 8) -> np.ndarray:
    """An RGBA tile as OpenSlide's read_region returns it at a slide's edge: tissue on the
    right, transparent black (0, 0, 0, 0) outside the scanned area on the left."""
    tile = np.zeros((12, 16, 4), dtype=np.uint8)
    tile[:, 8:, :3] = pixels(seed, (12, 8, 3))
    tile[:, 8:, 3] = 255
    return tile


@pytest.mark.parametrize("kind", ["numpy", "pil"])
def test_transparent_pixels_become_white(kind: str):
    tile = openslide_like()
    tile[:3, :8, :3] = (90, 10, 200)  # colour under alpha 0 is ignored too
    body = tile_body(tile if kind == "numpy" else Image.fromarray(tile, mode="RGBA"), **FIELDS)
    _, got = decoded(body)
    assert (got[:, :8] == 255).all()
    np.testing.assert_array_equal(got[:, 8:], tile[:, 8:, :3])


def test_half_transparent_pixels_are_blended():
    tile = np.array(
        [[[100, 0, 255, 51], [200, 50, 10, 102], [0, 0, 0, 128], [130, 1, 2, 100], [7, 8, 9, 255]]],
        dtype=np.uint8,
    )
    _, got = decoded(tile_body(tile, **FIELDS))
    # (pixel * alpha + 255 * (255 - alpha)) / 255 by hand, rounded to nearest:
    # 130 * 100 / 255 + 155 = 205.98 -> 206, 1 -> 155.39 -> 155, 2 -> 155.78 -> 156
    expected = [[224, 204, 255], [233, 173, 157], [127, 127, 127], [206, 155, 156], [7, 8, 9]]
    np.testing.assert_array_equal(got[0], expected)


def test_a_custom_background():
    tile = np.array([[[0, 0, 0, 0], [100, 0, 255, 51], [1, 2, 3, 255]]], dtype=np.uint8)
    _, got = decoded(tile_body(tile, **FIELDS, background=(240, 230, 250)))
    np.testing.assert_array_equal(got[0, 0], (240, 230, 250))
    # 0.2 * pixel + 0.8 * background
    np.testing.assert_array_equal(got[0, 1], (20 + 192, 184, 51 + 200))
    np.testing.assert_array_equal(got[0, 2], (1, 2, 3))
    _, black = decoded(tile_body(tile, **FIELDS, background=(0, 0, 0)))
    np.testing.assert_array_equal(black[0], [[0, 0, 0], [20, 0, 51], [1, 2, 3]])


def test_la_and_palette_transparency_are_composited():
    la = np.zeros((2, 3, 2), dtype=np.uint8)
    la[0] = (60, 255)
    la[1] = (60, 0)
    _, got = decoded(tile_body(Image.fromarray(la, mode="LA"), **FIELDS))
    np.testing.assert_array_equal(got[0], [[60, 60, 60]] * 3)
    np.testing.assert_array_equal(got[1], [[255, 255, 255]] * 3)

    palette = Image.new("P", (3, 2), 0)
    palette.putpalette([0, 0, 0, 10, 120, 30] + [0] * (254 * 3))
    palette.putpixel((0, 1), 1)
    palette.info["transparency"] = 0  # index 0 transparent, as in a PNG's tRNS
    _, got = decoded(tile_body(palette, **FIELDS, background=(250, 240, 230)))
    np.testing.assert_array_equal(got[1, 0], (10, 120, 30))
    np.testing.assert_array_equal(got[0, 0], (250, 240, 230))


# ---- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tile", "error", "words"),
    [
        (np.zeros((4, 4, 3), dtype=np.float64), TypeError, ["float64", "uint8", "(4, 4, 3)"]),
        (np.zeros((4, 4, 3), dtype=np.float32), TypeError, ["float32", "scale"]),
        (np.zeros((4, 4, 3), dtype=np.uint16), TypeError, ["uint16", "uint8"]),
        (np.zeros((4, 4), dtype=bool), TypeError, ["bool", "uint8"]),
        (np.zeros((4, 4, 2), dtype=np.uint8), ValueError, ["(4, 4, 2)", "(H, W, 3)"]),
        (np.zeros((2, 4, 4, 3), dtype=np.uint8), ValueError, ["(2, 4, 4, 3)"]),
        (np.zeros(12, dtype=np.uint8), ValueError, ["(12,)"]),
        (np.zeros((0, 4, 3), dtype=np.uint8), ValueError, ["empty"]),
        (np.zeros((4, 0), dtype=np.uint8), ValueError, ["empty"]),
        ([[0, 0], [0, 0]], TypeError, ["list", "PIL Image", "numpy"]),
        (b"\x89PNG\r\n", TypeError, ["bytes", "PIL Image"]),
        (Image.new("I;16", (4, 4)), ValueError, ["'I;16'", "8 bits"]),
        (Image.new("I", (4, 4)), ValueError, ["'I'"]),
        (Image.new("F", (4, 4)), ValueError, ["'F'"]),
        (Image.new("RGB", (0, 0)), ValueError, ["empty"]),
    ],
)
def test_refused_tiles_say_what_was_given(tile: Any, error: type[Exception], words: list[str]):
    with pytest.raises(error) as info:
        tile_body(tile, **FIELDS)
    for word in words:
        assert word in str(info.value)


class ArrayLike:
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.zeros((4, 4, 3), dtype=np.uint8)


def test_an_array_like_gets_a_hint():
    with pytest.raises(TypeError, match=r"ArrayLike.*numpy\.asarray"):
        tile_body(ArrayLike(), **FIELDS)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"x": True}, TypeError, "x must be an int, got bool"),
        ({"y": 5.0}, TypeError, "y must be an int, got float"),
        ({"patch_idx": "3"}, TypeError, "patch_idx must be an int, got str"),
        ({"x": -1}, ValueError, r"x must be in 0-9007199254740991 \(2\*\*53 - 1\), got -1"),
        ({"y": 2**53}, ValueError, "y must be in 0-9007199254740991"),  # not an exact JSON int
        ({"slide_name": 3}, TypeError, "slide_name must be a str, got int"),
        ({"tissue_ratio": 1.5}, ValueError, r"tissue_ratio must be in \[0, 1\], got 1.5"),
        ({"tissue_ratio": float("nan")}, ValueError, "tissue_ratio must be in"),
        ({"tissue_ratio": "0.5"}, TypeError, "tissue_ratio must be a float, got str"),
        ({"resolution": 0}, ValueError, "resolution must be a finite float > 0"),
        ({"resolution": float("inf")}, ValueError, "resolution must be a finite float > 0"),
        ({"background": (255, 255)}, ValueError, r"background must be an \(R, G, B\)"),
        ({"background": (256, 0, 0)}, ValueError, "background must be"),
        ({"background": (1.0, 0, 0)}, ValueError, "background must be"),
        ({"background": 255}, ValueError, "got 255"),
        ({"image_format": "jpeg"}, ValueError, "image_format must be 'png' or 'tiff', got 'jpeg'"),
    ],
)
def test_refused_fields_are_named(overrides: dict[str, Any], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        tile_body(pixels(9, (4, 4, 3)), **{**FIELDS, **overrides})


def test_importing_it_leaves_torch_out():
    code = (
        "import sys\n"
        "from histoinfer import tile_body\n"
        "import numpy as np\n"
        "tile_body(np.zeros((2, 2, 3), np.uint8), slide_name='s', x=0, y=0, patch_idx=0)\n"
        "heavy = [m for m in ('torch', 'histoinfer.models', 'histoinfer.batching', 'fastapi')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- end to end ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_numpy_and_pil_tiles_get_the_same_prediction(tiny_model: ServerModel):
    tile = np.zeros((224, 224, 4), dtype=np.uint8)
    tile[:, 100:, :3] = pixels(10, (224, 124, 3))
    tile[:, 100:, 3] = 255  # transparent on the left: outside the slide
    white = tile[:, :, :3].copy()
    white[:, :100] = 255
    with InProcessClient(tiny_model, dynamic_batching=False) as client:
        from_numpy, from_pil, expected, black = client.predict_batch(
            [
                tile_body(tile, **FIELDS),
                tile_body(Image.fromarray(tile, mode="RGBA"), **FIELDS),
                rgb_png_body(white),
                rgb_png_body(tile[:, :, :3]),  # what dropping alpha gives
            ]
        )
    output = json.loads(from_numpy)["output"]
    assert len(output) == tiny_model.metadata().output_size
    assert json.loads(from_pil)["output"] == pytest.approx(output, abs=1e-5)
    assert json.loads(expected)["output"] == pytest.approx(output, abs=1e-5)
    # and not what the model sees when alpha is dropped (black outside the slide)
    assert json.loads(black)["output"] != pytest.approx(output, abs=1e-3)


@pytest.mark.timeout(120)
def test_a_tiff_body_holds_the_same_pixels_and_gets_the_same_answer(tiny_model: ServerModel):
    rgba = pixels(11, (224, 224, 4))
    png, tiff = (tile_body(rgba, **FIELDS, image_format=kind) for kind in ("png", "tiff"))
    request = parse_request(tiff)
    image = Image.open(io.BytesIO(base64.b64decode(request.image_data, validate=True)))
    assert (image.format, image.mode, image.size) == ("TIFF", "RGB", (224, 224))
    assert np.array_equal(np.asarray(image), decoded(png)[1])  # composited alike
    assert request.model_dump(exclude={"image_data"}) == decoded(png)[0].model_dump(
        exclude={"image_data"}
    )
    with InProcessClient(tiny_model, dynamic_batching=False) as client:
        from_png, from_tiff = client.predict_batch([png, tiff])
    assert from_png == from_tiff
