"""``histoinfer bench --checkpoint PATH``: the sweep on a model of the user's own.

Short runs (a level, a few tiles, one round) and the argument layer: the report names the
checkpoint and labels its rows with it, bodies are built at its tile size, only the modes it
serves are swept, its targets are not evaluated, ``--import`` reaches every child process,
and what makes no sense is refused in one line before anything starts.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from histoinfer.bench.own import OwnModel, describe, modes_to_sweep, resolve_own
from histoinfer.bench.runner import BenchConfig, load_bodies
from histoinfer.cli import main

#: a short run: one level, a few tiles, one round (``--quick``'s lone-latency variants)
SHORT = ["--quick", "--levels=2", "--tiles=4", "--rounds=1", "--quiet"]

pytestmark = pytest.mark.usefixtures("private_registry")


@pytest.fixture
def own(tiny_dir: Path, tmp_path: Path) -> Path:
    """The tiny reference checkpoint, copied where a user's own would be."""
    folder = tmp_path / "mine"
    shutil.copytree(tiny_dir, folder)
    return folder / "model.pt2"


def _report(out: Path) -> tuple[dict[str, Any], str]:
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before any measurement (and so any child process) starts."""
    from histoinfer.bench import runner

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured after all")

    monkeypatch.setattr(runner, "run_bench", measured)


# -- a real run --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_own_checkpoint_is_measured_and_reported_as_its_own(
    own: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["bench", f"--checkpoint={own}", "--suites=throughput,latency,overhead"]
    argv += ["--paths=raw,explicit,dynamic-asyncio", "--shared-process", *SHORT]
    code = main([*argv, f"--workdir={tmp_path / 'work'}", f"--out={out}"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data, md = _report(out)
    config = data["config"]
    assert config["models"] == ["own:h1"]
    assert config["own"]["checkpoint"] == str(own.resolve())
    assert config["own"]["metadata"]["version"] == "0.1.0-reference-tiny"
    assert config["own"]["metadata"]["trained"] is False
    assert not (tmp_path / "work" / "h1-tiny").exists()  # no reference checkpoint exported
    for suite in ("throughput", "latency"):
        rows = data[suite]["rows"]
        assert rows and {row["model"] for row in rows} == {"own:h1"}
    assert "| own:h1 | explicit | predict | 2 |" in md
    assert (
        f"Own checkpoint `{own.resolve()}` (model key `h1`; name h1; version 0.1.0-reference-tiny;"
        in md
    )
    assert "tile size 224 px" in md and "trained: false" in md
    # The model's targets: the ratios, not evaluated; the scheduler's alone still are.
    model_checks = [*data["throughput"]["checks"], *data["latency"]["checks"]]
    assert model_checks and all(c["value"] is not None for c in model_checks)
    assert all(c["not_evaluated"] == "own checkpoint" and c["met"] is None for c in model_checks)
    assert "| not evaluated (own checkpoint) | own:h1 model, predict," in md
    assert all(not c["not_evaluated"] for c in data["overhead"]["checks"])
    assert "dynamic / explicit loop: " in printed and "not evaluated (own checkpoint)" in printed


class _MeanGenes(nn.Module):
    """Three "genes" from a tile's mean colour: a model of predictions alone, any tile size."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=(2, 3)))


def _predict_only(folder: Path, tile: int) -> Path:
    """A checkpoint serving ``predict`` alone, of tiles ``tile`` pixels a side."""
    folder.mkdir()
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    example = (torch.zeros(2, 3, tile, tile),)
    program = torch.export.export(_MeanGenes().eval(), example, dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(folder / "model.pt2"))
    assets = {
        "name": "mean-genes",
        "version": "2.0",
        "tile_size": tile,
        "resolution": 1.0,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "gene_names": ["A", "B", "C"],
        "modes": ["predict"],
    }
    (folder / "model.json").write_text(json.dumps(assets))
    return folder / "model.pt2"


@pytest.mark.timeout(60)
def test_bodies_are_at_the_models_tile_size_and_only_its_modes_are_swept(tmp_path: Path) -> None:
    checkpoint = _predict_only(tmp_path / "mean", 64)
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["bench", f"--checkpoint={checkpoint}", "--suites=throughput", "--shared-process"]
    argv += ["--paths=explicit,dynamic-asyncio", "--levels=2", "--tiles=4", "--rounds=1"]
    # Not --quick: every mode by default, of which the model serves predict alone.
    assert main([*argv, "--quiet", f"--workdir={work}", f"--out={out}"]) == 0
    data, md = _report(out)
    assert data["config"]["modes"] == ["predict"]
    assert {row["mode"] for row in data["throughput"]["rows"]} == {"predict"}
    [cached] = work.glob("bodies-*.json")
    assert cached.name == "bodies-4-seed0-64px.json"
    body = json.loads(json.loads(cached.read_text())[0])
    assert body["width"] == body["height"] == 64
    assert "tile size 64 px" in md and "trained: true" in md


def test_bodies_of_another_size_are_cached_apart(tmp_path: Path) -> None:
    small = load_bodies(2, 0, tmp_path, lambda _: None, 32)
    usual = load_bodies(2, 0, tmp_path, lambda _: None)
    assert json.loads(small[0])["width"] == 32 and json.loads(usual[0])["width"] == 224
    assert load_bodies(1, 0, tmp_path, lambda _: None, 32) == small[:1]  # read back, same size


# -- a model of the user's own, registered by --import ----------------------------------------

REGISTERING = """
    import os
    from pathlib import Path

    from histoinfer import register_model
    from histoinfer.models.h1 import H1ServerModel

    # Each process that imports this module says so: the bench's children must.
    (Path(__file__).parent / f"imported-{os.getpid()}").write_text("")

    @register_model("my-bench-key")
    class Mine(H1ServerModel):
        modes = ("predict",)
"""


@pytest.mark.timeout(90)
def test_an_imported_model_is_built_in_every_child_process(
    own: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.chdir(home)  # found from the current directory, as serve's --import finds it
    name = f"usermodels_{uuid.uuid4().hex[:10]}"
    (home / f"{name}.py").write_text(textwrap.dedent(REGISTERING))
    out = tmp_path / "out"
    argv = ["bench", f"--checkpoint={own}", "--model-key=my-bench-key", f"--import={name}"]
    argv += ["--suites=throughput,latency", "--paths=explicit,http", *SHORT]
    assert main([*argv, f"--workdir={tmp_path / 'work'}", f"--out={out}"]) == 0
    data, md = _report(out)
    assert "failed" not in data
    rows = data["throughput"]["rows"]
    assert {(row["model"], row["path"]) for row in rows} == {
        ("own:my-bench-key", "explicit"),
        ("own:my-bench-key", "http"),
    }
    assert {row["model"] for row in data["latency"]["rows"]} == {"own:my-bench-key"}
    assert data["config"]["own"]["imports"] == [name]
    assert f"--import={name}" in data["command"]
    assert f"imported: {name}" in md
    # This process, the explicit path's, the HTTP path's server, the lone-latency processes.
    importers = {int(p.name.removeprefix("imported-")) for p in home.glob("imported-*")}
    assert os.getpid() in importers and len(importers) >= 5


# -- refused, in one line, before anything runs -------------------------------------------------


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--models=tiny"], "--checkpoint cannot go with --models"),
        (["--small"], "--checkpoint cannot go with --small"),
        (["--dtype=bfloat16"], "--checkpoint cannot go with --dtype (precision belongs"),
        (["--suites=throughput,profile"], "--checkpoint cannot go with --suites profile"),
    ],
)
def test_options_that_make_no_sense_with_a_checkpoint_are_refused(
    options: list[str],
    says: str,
    own: Path,
    nothing_runs: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", f"--checkpoint={own}", *options]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"histoinfer bench: error: {says}")


@pytest.mark.parametrize("option", ["--model-key=h1", "--import=json"])
def test_a_checkpoints_options_without_one_are_refused(
    option: str, nothing_runs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", option]) == 2
    said = _one_line(capsys.readouterr().err)
    assert said.startswith(
        f"histoinfer bench: error: {option.split('=')[0]} goes with --checkpoint"
    )


def test_a_missing_checkpoint_is_named(
    tmp_path: Path, nothing_runs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere" / "model.pt2"
    assert main(["bench", f"--checkpoint={missing}"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == f"histoinfer: error: --checkpoint {missing}: no such file"


def test_a_bench_script_names_a_bad_checkpoint_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # benchmarks/*.py run the bench's own main(): the same line as histoinfer bench's.
    from histoinfer.bench.cli import main as script_main

    bad = tmp_path / "model.pt2"
    bad.write_bytes(b"not a program")
    argv = [f"--checkpoint={bad}", "--suites=throughput", "--quiet"]
    assert script_main(argv, prog="throughput.py") == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("throughput.py: error: ") and str(bad) in line, line


def test_a_folder_for_a_checkpoint_names_the_file_in_it(
    own: Path, nothing_runs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """As serve says it: ``histoinfer export --out`` makes a folder."""
    assert main(["bench", f"--checkpoint={own.parent}"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"--checkpoint {own.parent}: not a file (a folder: give the checkpoint file" in line


def test_a_module_that_fails_to_import_is_named(
    own: Path, nothing_runs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", f"--checkpoint={own}", "--import=usermodels_missing_here"]
    assert main(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert "--import usermodels_missing_here failed: ModuleNotFoundError" in line


def test_an_unregistered_key_is_named(
    own: Path, nothing_runs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", f"--checkpoint={own}", "--model-key=not-registered"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "--model-key not-registered: unknown model 'not-registered'" in line
    assert "--import the module that registers it" in line


# -- the modes swept -----------------------------------------------------------------------------


def test_only_the_modes_a_model_serves_are_swept() -> None:
    every = ("predict", "embed", "predict_with_embedding")
    assert modes_to_sweep(every, ("predict",), explicit=False) == ("predict",)
    assert modes_to_sweep(every, ("embed", "predict"), explicit=False) == ("predict", "embed")
    # --quick sweeps predict: an embedding model is swept in its own mode instead.
    assert modes_to_sweep(("predict",), ("embed",), explicit=False) == ("embed",)
    with pytest.raises(ValueError, match=r"--modes embed: the model serves predict only"):
        modes_to_sweep(("embed",), ("predict",), explicit=True)


def test_a_predict_only_checkpoint_sweeps_predict_alone(own: Path) -> None:
    assets = own.parent / "model.json"
    assets.write_text(json.dumps({**json.loads(assets.read_text()), "modes": ["predict"]}))
    cfg = BenchConfig(models=("own:h1",), own=OwnModel(str(own)))
    resolved = resolve_own(cfg, explicit_modes=False, log=lambda _: None)
    assert resolved.modes == ("predict",)
    assert resolved.own is not None and resolved.own.metadata["modes"] == ["predict"]
    assert resolved.modes_of("own:h1") == ("predict",)
    with pytest.raises(ValueError, match="the model serves predict only"):
        resolve_own(
            BenchConfig(models=("own:h1",), modes=("embed",), own=OwnModel(str(own))),
            explicit_modes=True,
            log=lambda _: None,
        )


def test_rows_are_labelled_by_the_models_name_or_its_key(own: Path) -> None:
    # Three checkpoints of one's own under the default key all read "own:h1" (a user trial).
    assets = own.parent / "model.json"
    assets.write_text(json.dumps({**json.loads(assets.read_text()), "name": "mycnn"}))
    cfg = BenchConfig(models=("own:h1",), own=OwnModel(str(own)))
    resolved = resolve_own(cfg, explicit_modes=False, log=lambda _: None)
    assert resolved.models == ("own:mycnn",) and resolved.is_own("own:mycnn")
    assert resolved.own is not None
    said = describe({**asdict(resolved.own), "checkpoint": str(own)})
    assert "measured as `own:mycnn`" in said  # as its rows read
    assert OwnModel(str(own), model_key="my-key").label == "own:my-key"


@pytest.mark.timeout(90)
def test_a_model_json_kept_elsewhere_is_found_with_assets(own: Path, tmp_path: Path) -> None:
    # serve and metadata take --assets; bench said to pass it and had none (a user trial).
    assets = tmp_path / "assets"
    assets.mkdir()
    (own.parent / "model.json").rename(assets / "model.json")
    out = tmp_path / "out"
    argv = ["bench", f"--checkpoint={own}", f"--assets={assets}", "--suites=throughput,latency"]
    argv += ["--paths=explicit,http", *SHORT, f"--workdir={tmp_path / 'work'}", f"--out={out}"]
    assert main(argv) == 0
    data, md = _report(out)
    assert "failed" not in data
    assert {row["path"] for row in data["throughput"]["rows"]} == {"explicit", "http"}
    assert data["latency"]["rows"]
    assert f"model.json from `{assets}`" in md
    assert main(["bench", f"--checkpoint={own}", "--quick"]) == 1  # not beside it


def test_assets_goes_with_a_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--assets=somewhere"]) == 2
    assert "--assets goes with --checkpoint" in capsys.readouterr().err
