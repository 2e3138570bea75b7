"""Checkpoints: both kinds of ``.pt2`` told apart by content, and every failure naming the file."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_body, outputs_close, save_program
from torch import nn

from histoinfer import InProcessClient, ServerModel, available_models, build_server_model
from histoinfer.errors import InferenceError, InvalidRequestError
from histoinfer.models import CheckpointError, base, checkpoint, load_checkpoint, registry
from histoinfer.models.base import BatchOutput
from histoinfer.models.checkpoint import (
    AOTI_INPUT_DTYPE_KEY,
    input_dtype,
    input_size,
    sniff_kind,
)
from histoinfer.models.genes import REFERENCE_GENE_PANEL
from histoinfer.models.h1 import H1ServerModel, export_reference_h1
from histoinfer.models.vit import VIT_SIZES
from histoinfer.schema import Mode


def edit_assets(folder: Path, **changes: Any) -> None:
    path = folder / "model.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def raises_naming(path: Path, fn: Callable[[], object], *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "Traceback" not in message and "\n" not in message
    return message


def test_export_checkpoint_loads_with_kind_and_sha256(tiny_checkpoint: Path) -> None:
    loaded = load_checkpoint(tiny_checkpoint)
    assert loaded.kind == "torch.export"
    assert loaded.path == tiny_checkpoint
    assert loaded.sha256 == hashlib.sha256(tiny_checkpoint.read_bytes()).hexdigest()


def test_kind_comes_from_content_not_name(copy_of_tiny: Path) -> None:
    renamed = copy_of_tiny / "weights.bin"
    (copy_of_tiny / "model.pt2").rename(renamed)
    assert sniff_kind(renamed) == "torch.export"
    model = build_server_model("h1", renamed)
    assert model.metadata().checkpoint_kind == "torch.export"


def test_metadata_reports_the_files_sha256_and_device(tiny_model: ServerModel) -> None:
    meta = tiny_model.metadata()
    path = tiny_model.checkpoint.path
    assert meta.checkpoint_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta.device == "cpu"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.pt2"
    raises_naming(path, lambda: load_checkpoint(path), "not found")


def test_missing_checkpoint_is_reported_before_missing_assets(tmp_path: Path) -> None:
    # Regression: a mistyped checkpoint path was reported as "model assets not found".
    path = tmp_path / "nowhere" / "model.pt2"
    message = raises_naming(path, lambda: build_server_model("h1", path), "not found")
    assert "model.json" not in message


def test_directory_instead_of_file(tmp_path: Path) -> None:
    message = raises_naming(tmp_path, lambda: load_checkpoint(tmp_path), "not a file")
    assert "give the checkpoint file" not in message  # nothing in it to name


def test_an_export_folder_instead_of_its_file_names_the_file(copy_of_tiny: Path) -> None:
    """`export --out ckpt` makes a folder, and users pass it (a user trial)."""
    raises_naming(
        copy_of_tiny,
        lambda: load_checkpoint(copy_of_tiny),
        f"a folder: give the checkpoint file in it, {copy_of_tiny / 'model.pt2'})",
    )


@pytest.mark.parametrize(
    "content", [b"", b"not a zip at all", b"PK\x03\x04" + b"\x00" * 64], ids=["empty", "text", "pk"]
)
def test_not_a_zip(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.pt2"
    path.write_bytes(content)
    raises_naming(path, lambda: load_checkpoint(path), "not a .pt2 archive")


def test_truncated_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    data = tiny_checkpoint.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    raises_naming(path, lambda: load_checkpoint(path))


def test_zip_of_the_wrong_kind(tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes/readme.txt", "hello")
    raises_naming(path, lambda: load_checkpoint(path), "neither a torch.export program")


def test_torch_save_file_is_the_wrong_kind(tmp_path: Path) -> None:
    # A state dict saved with torch.save is a zip too, but not a program.
    path = tmp_path / "model.pt2"
    torch.save({"weight": torch.zeros(3)}, path)
    raises_naming(
        path,
        lambda: load_checkpoint(path),
        "is a torch.save() file",
        "neither a torch.export program",
        "torch.export.export it",
        "docs/checkpoints.md",
    )


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # the test's own scripting
def test_a_torchscript_archive_is_named_as_such(tmp_path: Path) -> None:
    # torch.save's layout with code beside it: it was called a torch.save() file.
    path = tmp_path / "model.pt2"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    message = raises_naming(
        path, lambda: load_checkpoint(path), "is a TorchScript archive (torch.jit.save)"
    )
    assert "torch.save()" not in message


def test_corrupt_program_inside_a_valid_zip(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.pt2"
    with zipfile.ZipFile(tiny_checkpoint) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("models/model.json"):
                data = b"{ this is not the program }"
            dst.writestr(info, data)
    raises_naming(path, lambda: load_checkpoint(path), "could not be loaded")


def flip_a_byte(path: Path, member_suffix: str) -> str:
    """Flip one byte in the middle of the data of the member of ``path`` whose name ends with
    ``member_suffix``, as bit rot or a bad copy would; the member's full name."""
    with zipfile.ZipFile(path) as archive:
        [info] = [i for i in archive.infolist() if i.filename.endswith(member_suffix)]
    data = bytearray(path.read_bytes())
    # Where the data starts: after the local header, whose extra field (torch's alignment
    # padding) need not be the central directory's.
    name_length, extra_length = struct.unpack_from("<2H", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_length + extra_length
    data[start + info.compress_size // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return info.filename


def must_not_load(*_: object) -> None:
    raise AssertionError("a damaged checkpoint was loaded")


@pytest.mark.parametrize("member", ["data/weights/weight_1", "models/model.json"])
def test_a_damaged_member_is_refused_before_loading_naming_the_file_and_member(
    copy_of_tiny: Path, member: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a weight's byte flipped loaded silently, and the model answered other numbers.
    path = copy_of_tiny / "model.pt2"
    assert load_checkpoint(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    name = flip_a_byte(path, member)
    monkeypatch.setattr(checkpoint, "_load_program", must_not_load)
    raises_naming(path, lambda: load_checkpoint(path), "is damaged", repr(name), "CRC-32")
    raises_naming(path, lambda: build_server_model("h1", path), "is damaged", repr(name))


def test_a_damaged_aoti_package_is_refused_before_its_library_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The layout of a package, without its minute of compiling (the slow test below damages a
    # real one): a damaged .so is never handed to the loader to open.
    path = tmp_path / "package.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("package/data/aotinductor/model/model.wrapper.so", bytes(range(256)) * 64)
        archive.writestr("package/archive_format", "pt2")
    assert sniff_kind(path) == "aoti"
    name = flip_a_byte(path, ".wrapper.so")
    monkeypatch.setattr(checkpoint, "_load_program", must_not_load)
    raises_naming(path, lambda: load_checkpoint(path), "is damaged", repr(name))


def test_compressed_members_are_checked_too(tmp_path: Path) -> None:
    # No .pt2 writer compresses its members, but a zip tool re-packing one might.
    path = tmp_path / "model.pt2"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model/models/model.json", json.dumps({"weights": list(range(4000))}))
        archive.writestr("model/stored", b"as is", compress_type=zipfile.ZIP_STORED)
    members = zipfile.ZipFile(path).infolist()
    verified_sha256 = checkpoint.verified_sha256
    assert verified_sha256(path, members) == hashlib.sha256(path.read_bytes()).hexdigest()
    flip_a_byte(path, "models/model.json")
    raises_naming(
        path, lambda: verified_sha256(path, members), "is damaged", "'model/models/model.json'"
    )


@pytest.mark.parametrize(
    ("device", "fragment"),
    [
        ("nonsense", "not a torch device"),
        ("cpu:7", "the CPU is one device, with no index; use device='cpu'"),
        (
            None,
            "device must be a string such as 'cpu' or 'cuda:0', a torch.device or a CUDA "
            "index; got NoneType",
        ),
        pytest.param(
            "cuda",
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
        ),
        pytest.param(
            "mps",
            "mps is not available here",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is here"),
        ),
    ],
)
def test_unusable_device_names_the_file(
    tiny_checkpoint: Path, device: str | None, fragment: str
) -> None:
    # Regression (AOTInductor packages): a bad device escaped as a bare RuntimeError or
    # AssertionError, which the CLI printed as a traceback.
    raises_naming(
        tiny_checkpoint,
        lambda: build_server_model("h1", tiny_checkpoint, device=device),  # type: ignore[arg-type]
        repr(device) if device is not None else "device must be",
        fragment,
    )


def test_a_cpu_with_index_0_is_the_cpu(tiny_checkpoint: Path) -> None:
    assert build_server_model("h1", tiny_checkpoint, device="cpu:0").device == torch.device("cpu")


def test_checkpoint_error_is_catchable_as_inference_and_value_error() -> None:
    assert issubclass(CheckpointError, InferenceError)
    assert issubclass(CheckpointError, ValueError)


# -- assets ---------------------------------------------------------------------------------


def test_missing_assets(copy_of_tiny: Path) -> None:
    (copy_of_tiny / "model.json").unlink()
    raises_naming(
        copy_of_tiny / "model.json",
        lambda: build_server_model("h1", copy_of_tiny / "model.pt2"),
        "assets not found",
    )


def test_assets_from_another_folder(copy_of_tiny: Path, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (copy_of_tiny / "model.json").rename(assets / "model.json")
    model = build_server_model("h1", copy_of_tiny / "model.pt2", assets_dir=assets)
    assert model.metadata().name == "h1"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"tile_size": -1}, "tile_size"),
        ({"mean": [0.5, 0.5]}, "mean"),
        ({"std": [0.2, 0.0, 0.2]}, "std"),
        ({"interpolation": "magic"}, "interpolation"),
        ({"gene_names": ["A", "B", "A"]}, "more than once: A"),
        ({"gene_names": []}, "gene_names"),
        ({"surprise": 1}, "surprise"),
        ({"trained": "maybe"}, "trained"),
        # A typo is named, not guessed at (lax parsing took "no" as False, "224" as 224) ...
        ({"trained": "no"}, "trained"),
        ({"tile_size": "224"}, "tile_size"),
        # ... and a tile no request could send is refused before the probe asks torch for
        # 60 GB (a raw RuntimeError from deep in torch, a traceback on the command line).
        ({"tile_size": 100_000}, "tile_size: Input should be less than or equal to 4096"),
    ],
)
def test_invalid_assets_name_the_file_and_field(
    copy_of_tiny: Path, changes: dict[str, Any], fragment: str
) -> None:
    edit_assets(copy_of_tiny, **changes)
    raises_naming(
        copy_of_tiny / "model.json",
        lambda: build_server_model("h1", copy_of_tiny / "model.pt2"),
        "invalid",
        fragment,
    )


def test_assets_with_only_the_fields_spec_lists_load_as_trained(copy_of_tiny: Path) -> None:
    """SPEC's model.json has no ``trained``: a user's own checkpoint is taken as trained."""
    path = copy_of_tiny / "model.json"
    assets = json.loads(path.read_text())
    del assets["trained"]
    path.write_text(json.dumps(assets))
    assert build_server_model("h1", copy_of_tiny / "model.pt2").metadata().trained is True


def test_an_untrained_checkpoint_is_announced_once_a_process(
    tiny_model: ServerModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(base, "_announced", set())
    trained = tiny_model.assets.model_copy(update={"trained": True})
    with caplog.at_level("WARNING", logger="histoinfer.untrained"):
        H1ServerModel(tiny_model.checkpoint, trained)
        assert not caplog.records
        for _ in range(2):
            H1ServerModel(tiny_model.checkpoint, tiny_model.assets)
    [record] = caplog.records
    assert "UNTRAINED" in record.getMessage() and str(tiny_model.checkpoint.path) in record.message


def test_assets_that_are_not_json(copy_of_tiny: Path) -> None:
    (copy_of_tiny / "model.json").write_text("{ nope")
    raises_naming(
        copy_of_tiny / "model.json",
        lambda: build_server_model("h1", copy_of_tiny / "model.pt2"),
        "invalid",
    )


@pytest.mark.parametrize(
    ("changes", "what"),
    [({"embedding_size": 95}, "embedding"), ({"gene_names": ["A", "B"]}, "predictions")],
)
def test_assets_that_do_not_match_the_program(
    copy_of_tiny: Path, changes: dict[str, Any], what: str
) -> None:
    edit_assets(copy_of_tiny, **changes)
    path = copy_of_tiny / "model.pt2"
    raises_naming(path, lambda: build_server_model("h1", path), what, "model.json")


class _OneOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def test_program_with_the_wrong_outputs(copy_of_tiny: Path) -> None:
    path = save_program(_OneOutput(), copy_of_tiny)
    raises_naming(path, lambda: build_server_model("h1", path), "(predictions, embedding)")


# -- registry -------------------------------------------------------------------------------


def test_h1_is_registered() -> None:
    assert "h1" in available_models()
    assert registry.model_class("h1") is H1ServerModel


def test_unknown_registry_key_lists_the_available_ones(tiny_checkpoint: Path) -> None:
    with pytest.raises(InvalidRequestError) as info:
        build_server_model("h2", tiny_checkpoint)
    message = str(info.value)
    assert "'h2'" in message
    for key in available_models():
        assert key in message


def test_registered_subclass_is_built(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @registry.register_model("h1-test")
    class Custom(H1ServerModel):
        pass

    assert "h1-test" in available_models()
    assert type(build_server_model("h1-test", tiny_checkpoint)) is Custom
    # The same class again is fine; another class under a taken key is refused.
    registry.register_model("h1-test")(Custom)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_model("h1-test")(type("Other", (H1ServerModel,), {}))

    # Its definition run again (a notebook cell): the new class replaces the old.
    @registry.register_model("h1-test")
    class Custom(H1ServerModel):  # type: ignore[no-redef]
        pass

    assert registry.model_class("h1-test") is Custom


def test_a_builtin_key_taken_is_refused_at_the_decorator() -> None:
    """Not later, inside every lookup: the built-ins register when first looked up, so this
    runs in a fresh interpreter, before anything imported them."""
    script = textwrap.dedent(
        """
        from histoinfer import available_models, register_model
        from histoinfer.models.base import ServerModel
        try:
            @register_model("h1")
            class Mine(ServerModel):
                pass
        except ValueError as exc:
            print("refused:", exc)
        print(available_models())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "refused: a model is already registered as 'h1'" in done.stdout
    assert "'h1'" in done.stdout.splitlines()[-1]


# -- AOTInductor ----------------------------------------------------------------------------


# AOTInductor's compile uses torch.jit.script_method internally, which torch 2.13 deprecates:
# torch's own warning, nothing these tests or the library call.
_TORCH_OWN_JIT_WARNING = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


@pytest.mark.slow
@pytest.mark.timeout(600)
@_TORCH_OWN_JIT_WARNING
def test_aoti_package_matches_the_export_program(tmp_path: Path) -> None:
    export = export_reference_h1("tiny", tmp_path, aoti=True)
    assert export.aoti_checkpoint is not None and export.aoti_checkpoint.is_file()
    assert sniff_kind(export.aoti_checkpoint) == "aoti"
    aoti = build_server_model("h1", export.aoti_checkpoint)
    program = build_server_model("h1", export.checkpoint)
    assert aoti.metadata().checkpoint_kind == "aoti"
    assert aoti.checkpoint.input_dtype == torch.float32  # recorded in the package's metadata
    assert aoti.runner == "AOTInductor"
    assert aoti.metadata().checkpoint_sha256 != program.metadata().checkpoint_sha256

    # Same outputs, at several batch sizes (the batch dimension stays dynamic).
    for size in (1, 3, 8):
        tiles = torch.randint(0, 256, (size, 3, 224, 224), dtype=torch.uint8)
        a = aoti.forward_batch(tiles, "predict_with_embedding")
        b = program.forward_batch(tiles, "predict_with_embedding")
        assert a.predictions is not None and b.predictions is not None
        assert a.embedding is not None and b.embedding is not None
        torch.testing.assert_close(a.predictions, b.predictions, atol=1e-4, rtol=0)
        torch.testing.assert_close(a.embedding, b.embedding, atol=1e-4, rtol=0)

    # A package cannot change device: asking for another is a clear error, naming the file.
    for device, fragment in (("meta", "compiled for 'cpu'"), ("nonsense", "not a torch device")):
        raises_naming(
            export.aoti_checkpoint,
            lambda d=device: load_checkpoint(export.aoti_checkpoint, d),
            fragment,
        )

    # And end to end through the client, whatever the file is called.
    renamed = tmp_path / "package.bin"
    shutil.copy(export.aoti_checkpoint, renamed)

    # A damaged package is refused naming its member, before its library is opened.
    damaged = tmp_path / "damaged.pt2"
    shutil.copy(export.aoti_checkpoint, damaged)
    name = flip_a_byte(damaged, ".wrapper.so")
    raises_naming(damaged, lambda: load_checkpoint(damaged), "is damaged", repr(name))

    bodies = [make_body(i) for i in range(5)]
    with (
        InProcessClient.from_checkpoint(
            "h1", renamed, assets_dir=tmp_path, dynamic_batching=False
        ) as via_aoti,
        InProcessClient(program, dynamic_batching=False) as via_export,
    ):
        assert json.loads(via_aoti.metadata())["checkpoint_kind"] == "aoti"
        got = via_aoti.predict_with_embedding_batch(bodies)
        expected = via_export.predict_with_embedding_batch(bodies)
    for a_json, b_json in zip(got, expected, strict=True):
        assert outputs_close(a_json, b_json, tol=1e-4)


# -- reduced precision ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("h1-tiny-bfloat16")
    export_reference_h1("tiny", out, dtype="bfloat16")
    return out


def test_a_float32_program_takes_float32(tiny_model: ServerModel) -> None:
    assert tiny_model.checkpoint.input_dtype == torch.float32


def test_a_bfloat16_program_is_served_close_to_its_float32_twin(
    bf16_dir: Path, reference: InProcessClient
) -> None:
    model = build_server_model("h1", bf16_dir / "model.pt2")
    assert model.checkpoint.input_dtype == torch.bfloat16
    assert model.metadata().version.endswith("-bfloat16")
    with InProcessClient(model, dynamic_batching=False) as client:
        bodies = [make_body(i) for i in range(20)]  # 20 tiles: a sharded pass on a CPU
        low = client.predict_batch(bodies)
        full = reference.predict_batch(bodies)
    for a, b in zip(low, full, strict=True):
        x, y = json.loads(a)["output"], json.loads(b)["output"]
        assert len(x) == len(y)
        # It really ran in bfloat16 (8 bits of mantissa), and it is the same model.
        assert x != y
        assert outputs_close(a, b, tol=0.02)


def test_an_unknown_dtype_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        export_reference_h1("tiny", tmp_path, dtype="int8")
    assert not list(tmp_path.iterdir())


class _Package:
    """What the loader asks of an AOTInductor package: its metadata."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata = metadata

    def get_metadata(self) -> dict[str, str]:
        return self.metadata


def test_an_aoti_package_takes_the_dtype_its_metadata_records() -> None:
    assert input_dtype(_Package({})) == torch.float32  # the contract's, when it says nothing
    assert input_dtype(_Package({AOTI_INPUT_DTYPE_KEY: "bfloat16"})) == torch.bfloat16
    assert input_dtype(_Package({AOTI_INPUT_DTYPE_KEY: "torch.float16"})) == torch.float16
    for wrong in ("int8", "banana"):
        with pytest.raises(ValueError, match=f"{AOTI_INPUT_DTYPE_KEY}='{wrong}'"):
            input_dtype(_Package({AOTI_INPUT_DTYPE_KEY: wrong}))


class _ConvHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x).flatten(1)
        return y, y


@pytest.mark.slow
@pytest.mark.timeout(300)
@_TORCH_OWN_JIT_WARNING
def test_a_bfloat16_aoti_package_that_records_its_dtype_gets_bfloat16(tmp_path: Path) -> None:
    import torch._inductor as inductor

    module = _ConvHead().eval().to(torch.bfloat16)
    batch = torch.export.Dim("batch", min=1, max=16)
    example = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    program = torch.export.export(module, (example,), dynamic_shapes={"x": {0: batch}})
    path = tmp_path / "bf16.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own internals
        inductor.aoti_compile_and_package(
            program,
            package_path=str(path),
            inductor_configs={"aot_inductor.metadata": {AOTI_INPUT_DTYPE_KEY: "bfloat16"}},
        )
    loaded = load_checkpoint(path)
    assert loaded.kind == "aoti" and loaded.input_dtype == torch.bfloat16
    x = torch.randn(3, 3, 32, 32)
    got = loaded.program(x.to(loaded.input_dtype))
    torch.testing.assert_close(got[0], module(x.bfloat16())[0])


class _NonFinite(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.mean(dim=(1, 2, 3))[:, None]
        genes, dim = len(REFERENCE_GENE_PANEL), VIT_SIZES["tiny"].dim
        return rows.expand(-1, genes) * float("nan"), rows.expand(-1, dim).clone()


class _Means(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.mean(dim=(1, 2, 3))[:, None]
        genes, dim = len(REFERENCE_GENE_PANEL), VIT_SIZES["tiny"].dim
        return rows.expand(-1, genes).clone(), rows.expand(-1, dim).clone()


def test_a_program_exported_with_a_static_batch_is_refused_at_load(copy_of_tiny: Path) -> None:
    # A common mistake (no dynamic_shapes): its fx module takes batches of 2 only. It loaded
    # until the load probe ran a lone tile too (b6fa8c4), and then failed every lone request and
    # sharded pass; now the load refuses it with the export hint (tests/test_model_contract.py).
    path = copy_of_tiny / "model.pt2"
    torch.export.save(torch.export.export(_Means(), (torch.zeros(2, 3, 224, 224),)), str(path))
    raises_naming(
        path,
        lambda: build_server_model("h1", path),
        "[1, 3, 224, 224] probe batch",
        "dynamic batch dimension",
    )


@pytest.mark.parametrize(
    ("batch", "why"),
    [(1, "takes a batch of one tile only"), (4, "takes one batch size only")],
    ids=["one", "four"],
)
def test_a_program_exported_for_a_fixed_batch_is_refused_with_the_export_hint(
    copy_of_tiny: Path, batch: int, why: str
) -> None:
    """The mistake checkpoints.md warns of: an example batch of 1 specializes the batch to 1.
    The probe of two failed first, and its refusal said nothing of why (a user trial); nor did
    it for a batch of 4, failing with torch.export's guard alone (another)."""
    path = copy_of_tiny / "model.pt2"
    example = torch.zeros(batch, 3, 224, 224)
    torch.export.save(torch.export.export(_Means(), (example,)), str(path))
    raises_naming(
        path,
        lambda: build_server_model("h1", path),
        "[2, 3, 224, 224] probe batch",
        why,
        "dynamic batch dimension from 1",
    )


class _Unscripted(H1ServerModel):
    script_program = False


def test_a_tile_size_the_program_was_not_exported_for_is_named(copy_of_tiny: Path) -> None:
    """The probe failed with torch's guard alone ("x.size()[2] == 224"), or, with the program
    read from the TorchScript cache, with no word of sizes at all (a user trial)."""
    path = copy_of_tiny / "model.pt2"
    build_server_model("h1", path)  # its TorchScript translation cached, as a first load does
    assets = copy_of_tiny / "model.json"
    described = json.loads(assets.read_text())
    assets.write_text(json.dumps({**described, "tile_size": 256}))
    for model_class in (H1ServerModel, _Unscripted):  # from the cache, and the fx module
        raises_naming(
            path,
            partial(model_class.from_files, path),
            "was exported for tiles of 224x224 px, but its assets (model.json) say tile_size 256",
        )
    assert input_size(load_checkpoint(path).program) == (224, 224)


class _Embedding(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)).repeat(1, VIT_SIZES["tiny"].dim // 3)


class _EmbeddingInATuple(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x.mean(dim=(2, 3)).repeat(1, VIT_SIZES["tiny"].dim // 3),)


@pytest.mark.parametrize(
    ("program", "got"), [(_Embedding, "got Tensor"), (_EmbeddingInATuple, "got tuple of 1")]
)
def test_an_embedding_model_may_return_its_embedding_alone(
    copy_of_tiny: Path, program: type[nn.Module], got: str
) -> None:
    """checkpoints.md: a model serving embed alone needs no genes, and its program no
    predictions; a program returning one tensor was refused ("got Tensor")."""

    class EmbedOnly(H1ServerModel):
        modes = ["embed"]  # type: ignore[assignment]  # noqa: RUF012 - a list, as users write it

    edit_assets(copy_of_tiny, gene_names=[])
    path = save_program(program(), copy_of_tiny)
    model = EmbedOnly.from_files(path)
    tiles = torch.randint(0, 256, (3, 3, 224, 224), dtype=torch.uint8)
    out = model.forward_batch(tiles, "embed")
    assert out.predictions is None and out.embedding is not None
    assert out.embedding.shape == (3, VIT_SIZES["tiny"].dim)
    with InProcessClient(model) as client:
        assert len(json.loads(client.embed(make_body(0)))["output"]) == VIT_SIZES["tiny"].dim
    # A model that predicts too is told what such a program is for.
    edit_assets(copy_of_tiny, gene_names=list(REFERENCE_GENE_PANEL))
    raises_naming(path, lambda: build_server_model("h1", path), got, '"modes" in model.json')


def test_a_batch_of_the_wrong_shape_is_refused_before_the_program_runs(
    tiny_model: ServerModel,
) -> None:
    # A scripted program no longer runs export's own input guards: the model checks.
    with pytest.raises(ValueError, match=r"takes batches of shape \[B, 3, 224, 224\], got"):
        tiny_model.forward_batch(torch.zeros(2, 3, 64, 64, dtype=torch.uint8), "predict")


def test_a_program_answering_nan_is_refused_at_load(copy_of_tiny: Path) -> None:
    path = save_program(_NonFinite(), copy_of_tiny)
    raises_naming(
        path, lambda: build_server_model("h1", path), "non-finite predictions", "a broken program"
    )


class _PredictOnly(H1ServerModel):
    """Serves predict only; asked for an embedding (the load probe), it fills it with NaN."""

    modes = ("predict",)

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
        out = super().forward_batch(batch, mode)
        if mode == "predict":
            return out
        filler = torch.full((len(batch), VIT_SIZES["tiny"].dim), float("nan"))
        return BatchOutput(predictions=out.predictions, embedding=filler)


def test_only_the_outputs_a_served_mode_returns_must_be_finite(tiny_checkpoint: Path) -> None:
    model = _PredictOnly.from_files(tiny_checkpoint)  # its NaN embedding is never served
    with InProcessClient(model, dynamic_batching=False) as client:
        body = json.loads(client.predict(make_body(0)))
    assert len(body["output"]) == len(REFERENCE_GENE_PANEL)

    class _Both(_PredictOnly):
        modes = ("predict", "predict_with_embedding")

    load = lambda: _Both.from_files(tiny_checkpoint)  # noqa: E731
    raises_naming(tiny_checkpoint, load, "non-finite embedding")


class _EmbedOnly(H1ServerModel):
    """Serves embed only, with a program wrapper that returns no predictions at all."""

    modes = ("embed",)

    def forward_batch(self, batch: torch.Tensor, mode: Mode) -> BatchOutput:
        return BatchOutput(predictions=None, embedding=super().forward_batch(batch, mode).embedding)


def test_a_model_serving_embed_alone_need_not_return_predictions(
    tiny_checkpoint: Path, reference: InProcessClient
) -> None:
    model = _EmbedOnly.from_files(tiny_checkpoint)
    with InProcessClient(model, dynamic_batching=False) as client:
        assert client.embed(make_body(0)) == reference.embed(make_body(0))


def test_quieted_blocks_on_several_threads_leave_the_filters_as_they_were() -> None:
    """``warnings.catch_warnings`` swaps the process-wide filters: two blocks interleaved on two
    threads (two models loading) left one's filter installed for good, and ``-W error`` stopped
    working (a review). One block at a time."""
    import random
    import threading
    import time
    import warnings

    from histoinfer.models.checkpoint import quieted

    before = list(warnings.filters)

    def quiet_a_while() -> None:
        with quieted(DeprecationWarning):
            time.sleep(random.uniform(0, 0.01))

    threads = [threading.Thread(target=quiet_a_while) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert list(warnings.filters) == before
