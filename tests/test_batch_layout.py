"""Decoded tiles keep their pixels' layout, and fill channels-last CPU batches where the
program answers them exactly as it answers contiguous ones (``ServerModel.batch_layout``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import make_body, save_program
from torch import nn

from histoinfer.models import ServerModel, build_server_model, shards
from histoinfer.models.base import CHANNELS_LAST, BatchOutput, hwc_view, stack_tiles
from histoinfer.models.buffers import InputBuffer
from histoinfer.models.device_thread import device_thread
from histoinfer.models.genes import REFERENCE_GENE_PANEL
from histoinfer.models.h1 import H1ServerModel
from histoinfer.models.vit import VIT_SIZES
from histoinfer.schema import parse_request


def decoded(model: ServerModel, n: int, seed: int = 0) -> list[torch.Tensor]:
    return [model.prepare_sample(parse_request(make_body(seed + i))) for i in range(n)]


def batches_seen(model: ServerModel, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The float batches ``model``'s program is handed, recorded."""
    seen: list[torch.Tensor] = []
    run = model._run

    def spy(x: torch.Tensor, mode: Any) -> BatchOutput:
        seen.append(x.clone())  # the buffer is leased again to the next pass; same strides
        return run(x, mode)

    monkeypatch.setattr(model, "_run", spy)
    return seen


def outputs(out: BatchOutput) -> tuple[torch.Tensor, torch.Tensor]:
    assert out.predictions is not None and out.embedding is not None
    return out.predictions, out.embedding


def test_decoded_tiles_are_views_of_their_pixels(tiny_model: ServerModel) -> None:
    [tile] = decoded(tiny_model, 1)
    assert tile.dtype == torch.uint8 and tile.shape == (3, 224, 224)
    pixels = hwc_view(tile)
    assert pixels is not None and pixels.shape == (224, 224, 3)
    assert pixels.data_ptr() == tile.data_ptr()  # no copy was made
    assert hwc_view(tile.contiguous()) is None  # a [3, H, W]-contiguous tile is not one


@pytest.mark.parametrize("n", [1, 5, 23])
def test_a_channels_last_batch_answers_as_a_contiguous_one(
    tiny_model: ServerModel, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    assert tiny_model.batch_layout == CHANNELS_LAST
    tiles = decoded(tiny_model, n, seed=n)
    seen = batches_seen(tiny_model, monkeypatch)
    fast = outputs(tiny_model.forward_tiles(tiles, "predict_with_embedding"))
    plain = outputs(
        tiny_model.forward_tiles([t.contiguous() for t in tiles], "predict_with_embedding")
    )
    stacked = outputs(tiny_model.forward_batch(torch.stack(tiles), "predict_with_embedding"))
    first, second, third = seen
    assert first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()
    assert second.is_contiguous() and third.is_contiguous()
    assert torch.equal(first, second)  # the same normalized values, laid out otherwise
    for a, b, c in zip(fast, plain, stacked, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_sharded_pass_of_decoded_tiles_answers_as_one_pass(tiny_model: ServerModel) -> None:
    tiles = decoded(tiny_model, 24, seed=3)
    whole = outputs(tiny_model.forward_tiles(tiles, "predict_with_embedding"))
    sharded = device_thread("cpu").call(
        shards.forward, tiny_model, tiles, "predict_with_embedding", 2
    )
    for a, b in zip(outputs(sharded), whole, strict=True):
        torch.testing.assert_close(a, b)


def test_tiles_of_both_layouts_in_one_batch_fill_a_contiguous_one(
    tiny_model: ServerModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiles = decoded(tiny_model, 3, seed=9)
    mixed = [tiles[0], tiles[1].contiguous(), tiles[2]]
    seen = batches_seen(tiny_model, monkeypatch)
    got = outputs(tiny_model.forward_tiles(mixed, "predict_with_embedding"))
    want = outputs(tiny_model.forward_tiles(tiles, "predict_with_embedding"))
    assert seen[0].is_contiguous()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_tile_of_another_size_is_named(tiny_model: ServerModel) -> None:
    [tile] = decoded(tiny_model, 1)
    small = torch.zeros(112, 112, 3, dtype=torch.uint8).permute(2, 0, 1)  # laid out as decoded
    with pytest.raises(ValueError, match=r"tiles of shapes \(3, 224, 224\) and \(3, 112, 112\)"):
        tiny_model.forward_tiles([tile, small], "predict")


def test_stacking_for_an_accelerator_keeps_the_pixels_layout(tiny_model: ServerModel) -> None:
    tiles = decoded(tiny_model, 4)
    kept = stack_tiles(tiles, keep_layout=True)
    assert kept.is_contiguous(memory_format=torch.channels_last) and not kept.is_contiguous()
    assert torch.equal(kept, torch.stack(tiles))
    assert stack_tiles(tiles, keep_layout=False).is_contiguous()
    # Tiles that are not laid out as decoded are stacked as they are.
    assert stack_tiles([t.contiguous() for t in tiles], keep_layout=True).is_contiguous()


def test_a_batch_leased_for_another_device_is_contiguous_there() -> None:
    # The accelerator branch of the lease, on the meta device (no data, real strides): a
    # channels-last stack arrives contiguous, as the programs there were always fed.
    batch = torch.zeros(4, 224, 224, 3, dtype=torch.uint8).permute(0, 3, 1, 2)
    with InputBuffer().lease(batch, torch.device("meta")) as x:
        assert x.device.type == "meta" and x.dtype == torch.float32 and x.is_contiguous()


class _Flattens(nn.Module):
    """A program that needs a contiguous input: ``view`` refuses a channels-last one."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.view(x.shape[0], -1).mean(dim=1, keepdim=True)
        genes, dim = len(REFERENCE_GENE_PANEL), VIT_SIZES["tiny"].dim
        return rows.expand(-1, genes).clone(), rows.expand(-1, dim).clone()


def test_a_program_that_needs_a_contiguous_batch_gets_one(
    copy_of_tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_server_model("h1", save_program(_Flattens(), copy_of_tiny))
    assert model.batch_layout.startswith(
        "contiguous (the program fails on a channels-last batch of 2: "
    ), model.batch_layout
    tiles = decoded(model, 3)
    seen = batches_seen(model, monkeypatch)
    predictions, _ = outputs(model.forward_tiles(tiles, "predict_with_embedding"))
    assert seen[0].is_contiguous()
    x = torch.stack(tiles).float().mul_(model._scale).add_(model._shift)
    torch.testing.assert_close(predictions[:, 0], x.mean(dim=(1, 2, 3)))


class _AnswersOtherwise(H1ServerModel):
    """The reference program, a hair off when its batch is channels-last."""

    def _run_program(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        predictions, embedding = super()._run_program(x)
        return (predictions if x.is_contiguous() else predictions + 1e-6), embedding


class _Contiguous(H1ServerModel):
    channels_last_batches = False


def test_a_program_that_answers_a_channels_last_batch_otherwise_keeps_contiguous_ones(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _AnswersOtherwise.from_files(tiny_checkpoint)
    assert model.batch_layout == (
        "contiguous (the program's outputs differ on a channels-last batch of 2, by 1e-06 of "
        "their scale; channels_last_tolerance allows 0)"
    )
    seen = batches_seen(model, monkeypatch)
    model.forward_tiles(decoded(model, 2), "predict")
    assert seen[0].is_contiguous()


class _Tolerant(_AnswersOtherwise):
    channels_last_tolerance = 1e-5


class _TooFar(_AnswersOtherwise):
    channels_last_tolerance = 1e-7


def test_a_tolerance_takes_channels_last_batches_that_answer_a_hair_off(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CNN's kernels sum in another order on channels-last batches: its owner may accept that.
    model = _Tolerant.from_files(tiny_checkpoint)
    assert model.batch_layout == CHANNELS_LAST
    seen = batches_seen(model, monkeypatch)
    model.forward_tiles(decoded(model, 2), "predict")
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert _TooFar.from_files(tiny_checkpoint).batch_layout.startswith(
        "contiguous (the program's outputs differ on a channels-last batch of 2, by 1e-06"
    )


class _NaNOnChannelsLast(_Tolerant):
    """Predictions exact; the embedding NaN on a channels-last batch: no tolerance takes it."""

    def _run_program(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        predictions, embedding = H1ServerModel._run_program(self, x)
        return predictions, embedding if x.is_contiguous() else embedding * float("nan")


def test_a_nan_on_channels_last_batches_is_never_within_tolerance(tiny_checkpoint: Path) -> None:
    layout = _NaNOnChannelsLast.from_files(tiny_checkpoint).batch_layout
    assert layout.startswith("contiguous (the program's outputs differ") and "by inf" in layout


def test_channels_last_batches_can_be_turned_off(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Contiguous.from_files(tiny_checkpoint)
    assert model.batch_layout == "contiguous (channels_last_batches is False)"
    seen = batches_seen(model, monkeypatch)
    model.forward_tiles(decoded(model, 2), "predict")
    assert seen[0].is_contiguous()


class _OwnForward(H1ServerModel):
    """A subclass with its own ``forward_batch``: it sees every pass as a stacked batch."""

    stacks: ClassVar[list[torch.Tensor]] = []

    def forward_batch(self, batch: torch.Tensor, mode: Any) -> BatchOutput:
        self.stacks.append(batch.clone(memory_format=torch.preserve_format))
        return super().forward_batch(batch, mode)


def test_an_overridden_forward_batch_gets_a_contiguous_stack(
    tiny_checkpoint: Path, tiny_model: ServerModel
) -> None:
    model = _OwnForward.from_files(tiny_checkpoint)
    _OwnForward.stacks.clear()  # the load-time probe's
    tiles = decoded(model, 3)
    got = outputs(model.forward_tiles(tiles, "predict_with_embedding"))
    assert model.batch_layout == (
        "contiguous (forward_batch is overridden: it gets stacked batches)"
    )
    [stack] = _OwnForward.stacks
    assert stack.is_contiguous() and torch.equal(stack, torch.stack(tiles))
    want = outputs(tiny_model.forward_tiles(tiles, "predict_with_embedding"))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
