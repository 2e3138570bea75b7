"""What a user's own model owes the clients (SPEC §2.4), checked where a mistake is made: at load
(the probe), in ``model.json``, or in a subclass's ``postprocess``; each mistake a clear error."""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_body, save_program
from torch import nn

from histoinfer import InProcessClient, ServerModel, build_server_model
from histoinfer.errors import ModelExecutionError
from histoinfer.models import BatchOutput, CheckpointError, SampleOutput
from histoinfer.models.assets import load_assets
from histoinfer.models.genes import REFERENCE_GENE_PANEL
from histoinfer.models.h1 import H1ServerModel
from histoinfer.models.vit import VIT_SIZES
from histoinfer.schema import Mode, ModelRequest, ModelResponse

pytestmark = pytest.mark.timeout(120)

GENES, DIM = len(REFERENCE_GENE_PANEL), VIT_SIZES["tiny"].dim


def edit_assets(folder: Path, **changes: Any) -> None:
    path = folder / "model.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def load_fails(path: Path, *fragments: str, cls: type[ServerModel] = H1ServerModel) -> str:
    with pytest.raises(CheckpointError) as info:
        cls.from_files(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    return message


# -- the load-time probe ---------------------------------------------------------------------


class _Means(nn.Module):
    """Each tile's mean, as every gene and every embedding feature."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.mean(dim=(1, 2, 3))[:, None]
        return rows.expand(-1, GENES).clone(), rows.expand(-1, DIM).clone()


class _Squeezing(_Means):
    """A stray ``squeeze()``: a batch of one loses its batch dimension."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        predictions, embedding = super().forward(x)
        return predictions.squeeze(), embedding.squeeze()


def test_a_program_exported_for_a_fixed_batch_is_refused_at_load(copy_of_tiny: Path) -> None:
    """Regression: a program exported without dynamic shapes (batches of 2 only) loaded, then
    failed every lone request and every sharded pass: at low load, intermittently."""
    path = copy_of_tiny / "model.pt2"
    torch.export.save(torch.export.export(_Means(), (torch.zeros(2, 3, 224, 224),)), str(path))
    load_fails(path, str(path), "[1, 3, 224, 224] probe batch", "dynamic batch dimension")


def test_a_program_that_drops_the_batch_dimension_of_one_tile_is_refused_at_load(
    copy_of_tiny: Path,
) -> None:
    path = save_program(_Squeezing(), copy_of_tiny)
    load_fails(path, str(path), f"predictions of shape ({GENES},) for a probe batch of 1")


class _TupleForward(H1ServerModel):
    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> Any:
        return self.checkpoint.program(batch.float())


class _TupleEmbedding(H1ServerModel):
    modes = ("embed",)

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> Any:
        return BatchOutput(predictions=None, embedding=self.checkpoint.program(batch.float()))


@pytest.mark.parametrize(
    ("cls", "fragment"),
    [
        (_TupleForward, "forward_batch must return a BatchOutput (histoinfer.models), got tuple"),
        (_TupleEmbedding, "returns embedding of shape tuple (not a tensor)"),
    ],
    ids=["tuple", "tuple-in-a-BatchOutput"],
)
def test_a_forward_batch_returning_the_wrong_type_is_refused_at_load(
    tiny_checkpoint: Path, cls: type[ServerModel], fragment: str
) -> None:
    """Regression: an AttributeError from deep inside the probe, naming neither the file nor
    what was expected."""
    load_fails(tiny_checkpoint, str(tiny_checkpoint), fragment, cls=cls)


# -- model.json ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"mean": [123.675, 116.28, 103.53]}, "every mean must be in [0, 1]"),
        ({"std": [58.395, 57.12, 57.375]}, "every std must be at most 1"),
    ],
)
def test_a_mean_or_std_in_0_255_units_is_refused_with_the_fix(
    copy_of_tiny: Path, changes: dict[str, Any], fragment: str
) -> None:
    """Regression: accepted, every tile normalized to nearly the same constant, silently."""
    edit_assets(copy_of_tiny, **changes)
    load_fails(copy_of_tiny / "model.pt2", fragment, "divide them by 255")


class _EmbedOnly(H1ServerModel):
    modes = ("embed",)


@pytest.mark.parametrize("genes", [[], None], ids=["empty", "absent"])
def test_an_embedding_model_needs_no_gene_names(copy_of_tiny: Path, genes: Any) -> None:
    """Regression: an embedding-only model had to invent a gene to load."""
    data = json.loads((copy_of_tiny / "model.json").read_text())
    if genes is None:
        del data["gene_names"]
    else:
        data["gene_names"] = genes
    (copy_of_tiny / "model.json").write_text(json.dumps(data))
    model = _EmbedOnly.from_files(copy_of_tiny / "model.pt2")
    assert (model.metadata().gene_names, model.metadata().output_size) == ([], 0)
    with InProcessClient(model, dynamic_batching=False) as client:
        assert len(json.loads(client.embed(make_body(1)))["output"]) == DIM
    # A model that predicts still needs them.
    load_fails(copy_of_tiny / "model.pt2", "gene_names is empty", "predict")


def test_gene_names_can_be_a_gene_list_file_in_the_assets_directory(copy_of_tiny: Path) -> None:
    """SPEC §2.4: the assets directory holds model.json "and any gene lists"."""
    (copy_of_tiny / "genes.txt").write_text("\n".join(REFERENCE_GENE_PANEL) + "\n\n")
    edit_assets(copy_of_tiny, gene_names="genes.txt")
    model = build_server_model("h1", copy_of_tiny / "model.pt2")
    assert model.metadata().gene_names == list(REFERENCE_GENE_PANEL)
    assert model.assets.directory == copy_of_tiny  # for a subclass's own files
    (copy_of_tiny / "genes.txt").unlink()
    load_fails(copy_of_tiny / "model.pt2", "gene list", str(copy_of_tiny / "genes.txt"))


def test_a_byte_order_mark_and_windows_line_ends_are_not_part_of_any_name(
    copy_of_tiny: Path,
) -> None:
    """Excel's "CSV UTF-8" and Notepad start a file with a byte-order mark: it became part of
    the first gene's name, and looking that gene up failed silently."""
    genes = "\r\n".join(f"{g} " for g in REFERENCE_GENE_PANEL) + "\r\n"
    (copy_of_tiny / "genes.txt").write_bytes(codecs.BOM_UTF8 + genes.encode())
    edit_assets(copy_of_tiny, gene_names="genes.txt")
    assets = copy_of_tiny / "model.json"
    assets.write_bytes(codecs.BOM_UTF8 + assets.read_bytes())
    model = build_server_model("h1", copy_of_tiny / "model.pt2")
    assert model.metadata().gene_names == list(REFERENCE_GENE_PANEL)


def test_assets_built_in_code_have_no_directory(tiny_model: ServerModel) -> None:
    assets = load_assets(tiny_model.checkpoint.path.parent).model_copy()
    rebuilt = type(assets).model_validate(assets.model_dump())
    assert rebuilt.directory is None
    with pytest.raises(Exception, match="a file name needs an assets directory"):
        type(assets).model_validate({**assets.model_dump(), "gene_names": "genes.txt"})


# -- a subclass's postprocess ----------------------------------------------------------------


class _NanPostprocess(H1ServerModel):
    """Its own scaling, which divides by zero for one tile."""

    def postprocess(self, request: ModelRequest, output: SampleOutput, mode: Mode) -> ModelResponse:
        response = super().postprocess(request, output, mode)
        if request.patch_idx == 3:
            response.output = [math.nan, *response.output[1:]]
        return response


class _DictPostprocess(H1ServerModel):
    def postprocess(self, request: ModelRequest, output: SampleOutput, mode: Mode) -> Any:
        return super().postprocess(request, output, mode).model_dump()


def test_a_postprocess_producing_nan_fails_its_own_request(tiny_model: ServerModel) -> None:
    """Regression: answered ``"output": [null, ...]``, against the response schema, with no error
    (NaN from the forward pass was already an error)."""
    model = _NanPostprocess(tiny_model.checkpoint, tiny_model.assets)
    with InProcessClient(model, dynamic_batching=False) as client:
        # The step is named, not the model's pass (which was finite); in a batch call, the
        # position too, as every other error of a batch call does.
        blame = r"model 'h1': postprocess returned non-finite values \(NaN or infinity\) "
        with pytest.raises(ModelExecutionError, match=blame + r"for patch_idx=3 "):
            client.predict(make_body(3))
        answer = json.loads(client.predict(make_body(2)))
        assert all(isinstance(v, float) for v in answer["output"])
        with pytest.raises(
            ModelExecutionError, match=blame + r"at batch position 1 for patch_idx=3"
        ) as info:
            client.predict_batch([make_body(2), make_body(3)])
        assert info.value.positions == [1]


class _Unchecked(H1ServerModel):
    """A postprocess of its own that passes the pass's outputs on unchecked (the built-in one
    refuses non-finite ones)."""

    def postprocess(self, request: ModelRequest, output: SampleOutput, mode: Mode) -> ModelResponse:
        return super().postprocess(request, dataclasses.replace(output, finite=True), mode)


def test_a_non_finite_pass_is_blamed_on_the_model_past_a_postprocess_of_its_own(
    tiny_model: ServerModel,
) -> None:
    model = _Unchecked(tiny_model.checkpoint, tiny_model.assets)
    request = ModelRequest.model_validate_json(make_body(3))
    nan = SampleOutput(predictions=[math.nan, 1.0], embedding=None, finite=False)
    with pytest.raises(ModelExecutionError, match=r"^model 'h1' produced non-finite values"):
        model.response_json(request, nan, "predict")
    answer = model.response_json(request, SampleOutput([0.5, 1.0], None), "predict")
    assert json.loads(answer)["output"] == [0.5, 1.0]


def test_a_postprocess_returning_a_dict_is_named(tiny_model: ServerModel) -> None:
    model = _DictPostprocess(tiny_model.checkpoint, tiny_model.assets)
    message = r"must return a ModelResponse, got dict"
    with (
        InProcessClient(model, dynamic_batching=False) as client,
        pytest.raises(ModelExecutionError, match=message),
    ):
        client.predict(make_body(1))
