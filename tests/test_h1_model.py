"""The ``h1`` reference model and the ``ServerModel`` steps: prepare, forward, postprocess."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import make_body

from histoinfer import ServerModel, build_server_model
from histoinfer.errors import ModelExecutionError, UnsupportedModeError
from histoinfer.models import BatchOutput, SampleOutput
from histoinfer.models.genes import REFERENCE_GENE_PANEL
from histoinfer.models.h1 import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    H1ServerModel,
    _partial,
    _running,
    build_reference_module,
    export_reference_h1,
)
from histoinfer.models.vit import VIT_SIZES, GeneViT, ViTConfig
from histoinfer.schema import parse_request


def random_tiles(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=gen)


def test_metadata_is_honest_about_the_reference_model(tiny_model: ServerModel) -> None:
    meta = tiny_model.metadata()
    assert meta.name == "h1"
    assert meta.trained is False
    assert "untrained" in meta.description.lower()
    assert meta.tile_size == 224 and meta.resolution == 0.5
    assert meta.mean == IMAGENET_MEAN and meta.std == IMAGENET_STD
    assert meta.interpolation == "bilinear"
    assert set(meta.modes) == {"predict", "embed", "predict_with_embedding"}
    assert meta.output_size == len(meta.gene_names)
    assert meta.embedding_size == VIT_SIZES["tiny"].dim
    assert meta.accepts_bulk_rna is False


def test_assets_file_says_untrained(tiny_dir: Path) -> None:
    assets = json.loads((tiny_dir / "model.json").read_text())
    assert assets["trained"] is False
    assert "UNTRAINED" in assets["description"]
    assert assets["gene_names"] == list(REFERENCE_GENE_PANEL)


def test_gene_panel_looks_like_a_spatial_transcriptomics_panel() -> None:
    genes = REFERENCE_GENE_PANEL
    assert 200 <= len(genes) <= 400
    assert len(set(genes)) == len(genes)
    # HGNC symbols: upper case and digits (lower case only in "C15orf48"-style names).
    odd = [g for g in genes if not re.fullmatch(r"[A-Z][A-Z0-9-]*(orf[0-9]+)?", g)]
    assert not odd, odd
    # Classic markers: epithelium, immune, T cells, stroma, proliferation.
    assert {"EPCAM", "PTPRC", "CD3E", "ACTA2", "MKI67"} <= set(genes)


@pytest.mark.parametrize("batch", [1, 2, 5, 17])
def test_batch_dimension_is_dynamic(tiny_model: ServerModel, batch: int) -> None:
    out = tiny_model.forward_batch(random_tiles(batch), "predict_with_embedding")
    assert out.predictions is not None and out.embedding is not None
    assert tuple(out.predictions.shape) == (batch, len(REFERENCE_GENE_PANEL))
    assert tuple(out.embedding.shape) == (batch, VIT_SIZES["tiny"].dim)
    assert len(out) == batch and len(out.split()) == batch


def test_modes_return_only_what_they_need(tiny_model: ServerModel) -> None:
    tiles = random_tiles(3)
    predict = tiny_model.forward_batch(tiles, "predict")
    embed = tiny_model.forward_batch(tiles, "embed")
    both = tiny_model.forward_batch(tiles, "predict_with_embedding")
    assert predict.embedding is None and predict.predictions is not None
    assert embed.predictions is None and embed.embedding is not None
    assert both.predictions is not None and both.embedding is not None
    assert torch.equal(predict.predictions, both.predictions)
    assert torch.equal(embed.embedding, both.embedding)


def test_forward_normalizes_with_the_models_mean_and_std(tiny_model: ServerModel) -> None:
    tiles = random_tiles(4, seed=1)
    out = tiny_model.forward_batch(tiles, "predict_with_embedding")
    module = build_reference_module("tiny")
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        predictions, embedding = module((tiles.float() / 255.0 - mean) / std)
    torch.testing.assert_close(out.predictions, predictions, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.embedding, embedding, atol=1e-4, rtol=1e-4)


def test_rows_do_not_influence_each_other(tiny_model: ServerModel) -> None:
    tiles = random_tiles(6, seed=2)
    batched = tiny_model.forward_batch(tiles, "predict_with_embedding")
    for i in (0, 5):
        alone = tiny_model.forward_batch(tiles[i : i + 1], "predict_with_embedding")
        assert alone.predictions is not None and batched.predictions is not None
        torch.testing.assert_close(alone.predictions[0], batched.predictions[i], atol=1e-4, rtol=0)


def test_different_tiles_give_different_outputs(tiny_model: ServerModel) -> None:
    out = tiny_model.forward_batch(random_tiles(2, seed=3), "predict")
    assert out.predictions is not None
    assert not torch.allclose(out.predictions[0], out.predictions[1])


def test_forward_leaves_the_input_alone(tiny_model: ServerModel) -> None:
    tiles = random_tiles(2, seed=4)
    before = tiles.clone()
    tiny_model.forward_batch(tiles, "predict")
    assert torch.equal(tiles, before)
    # Regression: a float batch was normalized in place, so the caller's tensor changed.
    floats = tiles.float()
    snapshot = floats.clone()
    a = tiny_model.forward_batch(floats, "predict")
    b = tiny_model.forward_batch(floats, "predict")
    assert torch.equal(floats, snapshot)
    assert a.predictions is not None and b.predictions is not None
    assert torch.equal(a.predictions, b.predictions)


def test_forward_runs_without_autograd_on_any_thread(tiny_model: ServerModel) -> None:
    # Forward passes run on reused worker threads, where grad mode is whatever it was left as.
    results: list[torch.Tensor] = []

    def work() -> None:
        torch.set_grad_enabled(True)
        out = tiny_model.forward_batch(random_tiles(2), "predict_with_embedding")
        assert out.predictions is not None
        results.append(out.predictions)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    [predictions] = results
    assert not predictions.requires_grad
    assert predictions.grad_fn is None


def test_prepare_sample_gives_a_uint8_tile(tiny_model: ServerModel) -> None:
    tile = tiny_model.prepare_sample(parse_request(make_body(0, size=112)))
    assert tile.dtype == torch.uint8 and tuple(tile.shape) == (3, 224, 224)


def test_postprocess_echoes_the_request(tiny_model: ServerModel) -> None:
    request = parse_request(make_body(7))
    sample = SampleOutput(predictions=[1.0, 2.0], embedding=[3.0])
    predict = json.loads(tiny_model.postprocess(request, sample, "predict").model_dump_json())
    embed = json.loads(tiny_model.postprocess(request, sample, "embed").model_dump_json())
    both = json.loads(
        tiny_model.postprocess(request, sample, "predict_with_embedding").model_dump_json()
    )
    assert predict["output"] == [1.0, 2.0] and "embedding" not in predict
    assert embed["output"] == [3.0] and "embedding" not in embed
    assert both["output"] == [1.0, 2.0] and both["embedding"] == [3.0]
    echoed = request.model_dump(exclude={"image_data", "bulk_rna"})
    for response in (predict, embed, both):
        assert {k: response[k] for k in echoed} == echoed
        assert "image_data" not in response


def test_non_finite_outputs_fail_only_their_own_sample(tiny_model: ServerModel) -> None:
    # JSON has no NaN: serialized, it became null, a response our own schema rejects.
    predictions = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0]])
    embedding = torch.tensor([[0.0], [1.0], [float("inf")]])
    samples = BatchOutput(predictions, embedding).split()
    assert [s.finite for s in samples] == [True, False, False]
    assert [s.finite for s in BatchOutput(predictions, None).split()] == [True, False, True]
    request = parse_request(make_body(9))
    assert tiny_model.postprocess(request, samples[0], "predict").output == [1.0, 2.0]
    with pytest.raises(ModelExecutionError, match=r"non-finite.*patch_idx=9"):
        tiny_model.postprocess(request, samples[1], "predict")


def test_bulk_rna_is_refused_by_h1(tiny_model: ServerModel) -> None:
    request = parse_request(make_body(0, bulk_rna=[1.0, 2.0]))
    with pytest.raises(UnsupportedModeError, match="'bulk_rna'"):
        tiny_model.check_request(request, "predict", "for test")


def test_a_model_without_a_mode_refuses_it(tiny_model: ServerModel) -> None:
    class EmbedOnly(H1ServerModel):
        modes = ("embed",)

    model = EmbedOnly(tiny_model.checkpoint, tiny_model.assets)
    assert model.metadata().modes == ["embed"]
    with pytest.raises(UnsupportedModeError, match=r"'predict'.*supported: embed"):
        model.check_mode("predict")
    model.check_mode("embed")


def test_reference_export_is_deterministic(tiny_model: ServerModel, tmp_path: Path) -> None:
    export = export_reference_h1("tiny", tmp_path)
    again = build_server_model("h1", export.checkpoint)
    tiles = random_tiles(3, seed=5)
    a = tiny_model.forward_batch(tiles, "predict_with_embedding")
    b = again.forward_batch(tiles, "predict_with_embedding")
    assert a.predictions is not None and b.predictions is not None
    assert torch.equal(a.predictions, b.predictions)
    assert not list(tmp_path.glob("*partial*")), "a half-written file was left behind"
    # Byte for byte: the archive's top folder was named after a tagged temporary file, so
    # every export had its own sha256 (the demo's provenance, the TorchScript cache's key).
    assert again.checkpoint.sha256 == tiny_model.checkpoint.sha256


def test_small_is_vit_s_sized() -> None:
    module = build_reference_module("small")
    params = sum(p.numel() for p in module.parameters())
    assert module.config.dim == 384 and module.config.depth == 12
    assert 20e6 < params < 25e6, params


def test_unknown_size_and_bad_geometry_are_refused() -> None:
    with pytest.raises(ValueError, match="tiny"):
        build_reference_module("huge")
    with pytest.raises(ValueError, match="multiple of patch_size"):
        GeneViT(ViTConfig(tile_size=100, patch_size=16), num_genes=3)


def test_partial_files_are_private_and_renamed_only_when_complete(tmp_path: Path) -> None:
    final = tmp_path / "model.pt2"
    with _partial(final) as a, _partial(final) as b:
        # Two writers of the same file (two first runs of the demo) never share a file.
        assert a != b and a.name == b.name == "model.pt2"  # the archive's folder: "model"
        assert a.parent.parent == b.parent.parent == tmp_path
        a.write_text("first")
        b.write_text("second")
        assert not final.exists()
    assert final.read_text() == "first"  # the outer one finished last
    with pytest.raises(RuntimeError), _partial(final) as c:
        c.write_text("half")
        raise RuntimeError("export failed")
    assert final.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]


@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(pid, 0) terminates on Windows")
def test_a_killed_exports_private_folder_is_removed_by_the_next_an_hour_later(
    tmp_path: Path,
) -> None:
    final = tmp_path / "model.pt2"
    dead = _a_pid_that_is_not_running()
    abandoned, young, alive = (
        tmp_path / f".model.pt2.partial-{pid}-0a1b2c3d" for pid in (dead, dead, os.getpid())
    )
    young = young.with_name(young.name.replace("0a1b2c3d", "4e5f6a7b"))
    for folder in abandoned, young, alive:
        folder.mkdir()
        (folder / "model.pt2").write_text("half")
    hour_ago = time.time() - 3601
    for folder in abandoned, alive:  # a long AOTInductor compile writes nothing for minutes
        os.utime(folder, (hour_ago, hour_ago))
    other = tmp_path / ".assets.json.partial-1-0a1b2c3d"  # another file's: its own export's
    other.mkdir()
    os.utime(other, (hour_ago, hour_ago))
    with _partial(final) as partial:
        partial.write_text("whole")
    assert final.read_text() == "whole"
    assert not abandoned.exists()
    assert (young / "model.pt2").read_text() == "half"  # another export, maybe still writing
    assert (alive / "model.pt2").read_text() == "half"  # its writer still runs
    assert other.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="os.kill(pid, 0) terminates on Windows")
def test_on_windows_no_process_is_signalled_to_see_whether_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """There os.kill(pid, 0) would terminate the process: every writer counts as running."""
    dead = str(_a_pid_that_is_not_running())
    assert not _running(dead)

    def kill(pid: int, sig: int) -> None:
        raise AssertionError(f"os.kill({pid}, {sig}) called")

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(sys, "platform", "win32")
    assert _running(dead)


def _a_pid_that_is_not_running() -> int:
    pid = 4_000_000  # above Linux's largest pid_max (2**22): never a running process
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid += 1
