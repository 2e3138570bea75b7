"""A model owner's own export under ``h1`` (a user trial): its run-time checks, a module exported
in training mode, a program of one output, and ``model.json``'s ``modes``; each either served
as the owner's module answers, or refused at load saying what to change."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from concurrency_helpers import all_at_once
from helpers import make_body, save_program
from PIL import Image
from test_model_contract import DIM, GENES, edit_assets, load_fails
from torch import nn

from histoinfer import InProcessClient
from histoinfer.errors import ModelExecutionError, UnsupportedModeError
from histoinfer.models import BatchOutput
from histoinfer.models.h1 import H1ServerModel
from histoinfer.schema import Mode, ModelRequest

pytestmark = pytest.mark.timeout(120)


def _white_body(i: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (224, 224), (255, 255, 255)).save(buf, format="PNG")
    return make_body(i, image_data=base64.b64encode(buf.getvalue()).decode())


class _Features(nn.Module):
    """A small convolutional model: predictions and embedding from pooled features."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, kernel_size=7, stride=7)
        self.norm = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.embed = nn.Linear(8, DIM)
        self.head = nn.Linear(DIM, GENES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.drop(self.norm(self.conv(x)).mean(dim=(2, 3)))
        embedding = self.embed(features)
        return self.head(embedding), embedding


class _Checked(_Features):
    """Refuses a tile too bright, as a model owner's own check would."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch._assert_async((x.mean(dim=(1, 2, 3)) < 1.5).all(), "tile too bright")
        return super().forward(x)


# -- the program's own checks ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_program_s_own_check_fails_its_tile_when_scripted(copy_of_tiny: Path) -> None:
    """Regression: TorchScript drops an op that returns nothing, so the scripted graph answered
    a white tile its own program refuses (the fx module raised; a user trial)."""
    path = save_program(_Checked().eval(), copy_of_tiny)
    model = H1ServerModel.from_files(path)
    assert model.runner == "TorchScript interpreter"
    bodies = [_white_body(i) if i == 2 else make_body(i) for i in range(4)]
    async with InProcessClient(model, max_batch_size=4) as client:
        results = await all_at_once(client, bodies)
    error = results.pop(2)
    assert isinstance(error, ModelExecutionError)
    # as the fx module says it: the owner's message, not the interpreter's traceback
    assert "RuntimeError('tile too bright')" in str(error)
    assert "TorchScript" not in str(error)
    assert "patch_idx=2" in str(error)
    assert all(
        isinstance(answer, str) and len(json.loads(answer)["output"]) == GENES
        for answer in results.values()
    )


def test_an_error_raised_in_the_interpreter_reads_as_the_fx_module_s() -> None:
    from histoinfer.models.scripted import interpreter_error

    wrapped = RuntimeError(
        "The following operation failed in the TorchScript interpreter.\n"
        "Traceback of TorchScript (most recent call last):\n"
        '  File "<eval_with_key>.23", line 8, in forward\n'
        "    matmul = torch.ops.aten.matmul(reshape, ones)\n"
        "             ~~~~~~~~~~~~~~~~~~~~~ <--- HERE\n"
        "ValueError: shapes (2x6 and 5x2)\n"
        "cannot be multiplied\n"
    )
    unwrapped = interpreter_error(wrapped)
    assert type(unwrapped) is ValueError
    assert str(unwrapped) == "shapes (2x6 and 5x2)\ncannot be multiplied"
    other = RuntimeError("CUDA out of memory")
    assert interpreter_error(other) is other


# -- a module exported in training mode ------------------------------------------------------


def test_batch_statistics_are_refused_at_load(copy_of_tiny: Path) -> None:
    """Regression: a BatchNorm left in training mode loaded; each tile's answer then depended
    on the tiles batched with it (0.089 on outputs of 0.61 in a user trial)."""
    module = _Features().train()
    module.drop.eval()  # batch statistics alone
    path = save_program(module, copy_of_tiny)
    load_fails(path, str(path), "beside another tile", "BatchNorm", "model.eval()")


def test_dropout_left_on_is_refused_at_load(copy_of_tiny: Path) -> None:
    """Regression: served, with a different answer to each call of the same tile."""
    module = _Features().eval()
    module.drop.train()
    path = save_program(module, copy_of_tiny)
    load_fails(path, str(path), "differently each time", "dropout", "model.eval()")


class _MonteCarlo(H1ServerModel):
    repeatable_outputs = False


def test_a_model_random_by_design_may_say_so(copy_of_tiny: Path) -> None:
    module = _Features().eval()
    module.drop.train()
    model = _MonteCarlo.from_files(save_program(module, copy_of_tiny))
    with InProcessClient(model, dynamic_batching=False) as client:
        first, second = (json.loads(client.predict(make_body(1)))["output"] for _ in range(2))
    assert first != second


def test_a_module_exported_after_eval_answers_as_it_does(copy_of_tiny: Path) -> None:
    module = _Features().eval()
    model = H1ServerModel.from_files(save_program(module, copy_of_tiny))
    bodies = [make_body(i) for i in range(3)]
    with InProcessClient(model, dynamic_batching=False) as client:
        got = torch.tensor([json.loads(a)["output"] for a in client.predict_batch(bodies)])
    pixels = torch.stack(
        [model.prepare_sample(ModelRequest.model_validate_json(body)) for body in bodies]
    )
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (model.assets.mean, model.assets.std))
    with torch.no_grad():
        want, _ = module((pixels.float() / 255 - mean) / std)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# -- programs of one output, and model.json's modes ------------------------------------------


class _EmbeddingAlone(_Features):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[1]


class _PredictionsAlone(_Features):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


@pytest.mark.parametrize(
    ("module", "served", "refused"),
    [
        (_EmbeddingAlone(), "embed", "predict"),
        (_PredictionsAlone(), "predict", "embed"),
    ],
    ids=["embedding", "predictions"],
)
def test_a_program_of_one_output_is_served_by_model_json_s_modes(
    copy_of_tiny: Path, module: nn.Module, served: str, refused: str
) -> None:
    """Regression: an embedding model (a foundation model's) needed a ServerModel subclass
    and ``--import`` to be served; a prediction model could not be served at all."""
    path = save_program(module.eval(), copy_of_tiny)
    load_fails(path, "got Tensor", '"modes" in model.json')
    edit_assets(copy_of_tiny, modes=[served], **({"gene_names": []} if served == "embed" else {}))
    model = H1ServerModel.from_files(path)
    assert model.metadata().modes == [served]
    size = DIM if served == "embed" else GENES
    with InProcessClient(model, dynamic_batching=False) as client:
        answer = client.embed(make_body(1)) if served == "embed" else client.predict(make_body(1))
        assert len(json.loads(answer)["output"]) == size
        with pytest.raises(UnsupportedModeError, match=f"does not support mode '{refused}'"):
            getattr(client, refused)(make_body(1))
    # Another instance of the class still serves the class's modes.
    assert H1ServerModel.modes == ("predict", "embed", "predict_with_embedding")


@pytest.mark.parametrize(
    ("modes", "fragment"),
    [
        (["embed", "embed"], "modes named more than once: embed"),
        ([], "modes: List should have at least 1 item"),
        (["predict_embedding"], "modes.0: Input should be"),
    ],
)
def test_model_json_s_modes_are_checked(
    copy_of_tiny: Path, modes: list[str], fragment: str
) -> None:
    edit_assets(copy_of_tiny, modes=modes)
    load_fails(copy_of_tiny / "model.pt2", fragment)


class _EmbedClass(H1ServerModel):
    modes = ("embed",)


def test_model_json_s_modes_only_narrow_the_class_s(copy_of_tiny: Path) -> None:
    edit_assets(copy_of_tiny, modes=["predict"])
    load_fails(
        copy_of_tiny / "model.pt2",
        "modes predict not among the modes it serves (embed)",
        cls=_EmbedClass,
    )


class _Dict(_Features):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        predictions, embedding = super().forward(x)
        return {"predictions": predictions, "embedding": embedding}


def test_a_dict_output_is_refused_saying_what_to_return(copy_of_tiny: Path) -> None:
    """Regression: the refusal's hint was about embedding-only models."""
    path = save_program(_Dict().eval(), copy_of_tiny)
    message = load_fails(path, "must return a tuple (predictions, embedding), got dict")
    assert "modes" not in message


def test_a_misspelt_model_json_key_names_the_key_it_is_close_to(copy_of_tiny: Path) -> None:
    data = json.loads((copy_of_tiny / "model.json").read_text())
    data["genenames"] = data.pop("gene_names")
    (copy_of_tiny / "model.json").write_text(json.dumps(data))
    load_fails(
        copy_of_tiny / "model.pt2",
        "genenames: Extra inputs are not permitted (did you mean 'gene_names'?)",
    )


class _Jittered(H1ServerModel):
    """Test-time noise of its own, in its forward_batch: the program itself is fine."""

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
        out = super().forward_batch(batch, mode)
        noisy = {
            name: None if value is None else value + torch.randn_like(value)
            for name, value in (("predictions", out.predictions), ("embedding", out.embedding))
        }
        return BatchOutput(**noisy)


def test_a_random_forward_batch_of_a_subclass_is_named(tiny_checkpoint: Path) -> None:
    load_fails(
        tiny_checkpoint, "differently each time", "is _Jittered.forward_batch random", cls=_Jittered
    )
