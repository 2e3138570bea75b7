"""A model whose predictions are not a vector of genes: a tissue mask (a user trial). Its
``model.json`` gives ``output_shape``; the program returns ``[B, H, W]`` (or ``[B, H*W]``);
each response's ``output`` is the mask row-major, the same in-process and over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
import torch
from helpers import make_body, outputs_close, save_program, serving
from test_model_contract import edit_assets, load_fails
from torch import nn

from histoinfer import HttpClient, InProcessClient
from histoinfer.models.h1 import H1ServerModel
from histoinfer.server import create_app

pytestmark = pytest.mark.timeout(120)

GRID = 14


class _TissueMask(nn.Module):
    """A tile's darkness on a 14x14 grid (tissue is darker than the white background)."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.flat = flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        darkness = torch.sigmoid(-x.mean(dim=1))  # [B, 224, 224]
        cells = nn.functional.adaptive_avg_pool2d(darkness, GRID)  # [B, 14, 14]
        return cells.flatten(1) if self.flat else cells


def _mask_assets(folder: Path, **changes: object) -> None:
    data = json.loads((folder / "model.json").read_text())
    data.pop("embedding_size")  # a mask model has no embedding to size
    data.update(task="tissue-mask", gene_names=[], modes=["predict"], output_shape=[GRID, GRID])
    data.update(changes)
    (folder / "model.json").write_text(json.dumps(data))


def _expected(module: nn.Module, model: H1ServerModel, body: str) -> np.ndarray:
    """What the module itself answers for the body's tile, normalized as the model does."""
    from histoinfer.schema import parse_request

    tile = model.prepare_sample(parse_request(body))
    mean = torch.tensor(model.assets.mean).view(3, 1, 1)
    std = torch.tensor(model.assets.std).view(3, 1, 1)
    with torch.no_grad():
        out = module(((tile.float() / 255 - mean) / std)[None])
    return out.reshape(GRID, GRID).numpy()


@pytest.mark.parametrize("flat", [False, True], ids=["shaped", "flat"])
def test_a_tissue_mask_model_is_served_from_model_json(copy_of_tiny: Path, flat: bool) -> None:
    module = _TissueMask(flat).eval()
    path = save_program(module, copy_of_tiny)
    _mask_assets(copy_of_tiny)
    model = H1ServerModel.from_files(path)
    meta = model.metadata()
    assert (meta.task, meta.modes, meta.gene_names) == ("tissue-mask", ["predict"], [])
    assert (meta.output_shape, meta.output_size, meta.embedding_size) == ([GRID, GRID], 196, 0)
    bodies = [make_body(i) for i in range(3)]
    with InProcessClient(model, dynamic_batching=False) as client:
        one = json.loads(client.predict(bodies[0]))
        batch = [json.loads(r) for r in client.predict_batch(bodies)]
    mask = np.asarray(one["output"]).reshape(meta.output_shape)
    np.testing.assert_allclose(mask, _expected(module, model, bodies[0]), rtol=1e-5, atol=1e-6)
    assert [r["patch_idx"] for r in batch] == [0, 1, 2]
    np.testing.assert_allclose(batch[0]["output"], one["output"], rtol=1e-5, atol=1e-6)


@pytest.mark.anyio
async def test_a_mask_is_the_same_over_http(copy_of_tiny: Path) -> None:
    path = save_program(_TissueMask().eval(), copy_of_tiny)
    _mask_assets(copy_of_tiny)
    model = H1ServerModel.from_files(path)
    bodies = [make_body(i) for i in range(4)]
    with InProcessClient(model, dynamic_batching=False) as local:
        expected = local.predict_batch(bodies)
        metadata = json.loads(local.metadata())
    app = create_app({"mask": InProcessClient(model)}, warmup=False)  # dynamic batching
    async with serving(app) as http:
        transport = httpx.ASGITransport(app=app)
        async with HttpClient("http://asgi", "mask", transport=transport, retries=0) as remote:
            with anyio.fail_after(30):
                assert await remote.predict_batch_async(bodies) == expected
                assert outputs_close(await remote.predict_async(bodies[1]), expected[1])
        served = (await http.get("/api/metadata/mask")).json()
    assert served["output_shape"] == metadata["output_shape"] == [GRID, GRID]


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"output_shape": [GRID, 0]}, "output_shape: every dimension must be > 0"),
        ({"gene_names": ["a", "b"]}, "output_shape: gene_names has 2 names, but"),
        ({"output_shape": [7, 7]}, "returns predictions of shape (2, 14, 14) for a probe batch"),
        ({"modes": ["predict", "embed"]}, "embedding_size is missing, but it serves embed"),
    ],
    ids=["zero", "names", "shape", "embedding"],
)
def test_a_mask_model_json_that_does_not_fit_is_refused(
    copy_of_tiny: Path, changes: dict[str, object], fragment: str
) -> None:
    path = save_program(_TissueMask().eval(), copy_of_tiny)
    _mask_assets(copy_of_tiny, **changes)
    message = load_fails(path, fragment)
    if "(2, 14, 14)" in message:  # both layouts the model would take are named
        assert "describe (2, 7, 7) or (2, 49)" in message


def test_a_model_serving_embed_alone_reports_no_predictions(copy_of_tiny: Path) -> None:
    """Its model.json's output_shape (or genes) describe nothing it serves (a trial: it
    reported a 14x14 output)."""
    edit_assets(copy_of_tiny, modes=["embed"], output_shape=[4, 4], gene_names=[])
    meta = H1ServerModel.from_files(copy_of_tiny / "model.pt2").metadata()
    assert (meta.modes, meta.output_size, meta.output_shape) == (["embed"], 0, None)


def test_predictions_with_neither_names_nor_a_shape_are_refused(copy_of_tiny: Path) -> None:
    save_program(_TissueMask(flat=True).eval(), copy_of_tiny)
    edit_assets(copy_of_tiny, gene_names=[], modes=["predict"])
    load_fails(copy_of_tiny / "model.pt2", "gene_names is empty", "output_shape")
