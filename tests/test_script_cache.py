"""The TorchScript cache (models/script_cache.py): a second load reads the translation the
first one checked and kept, answers exactly alike, and any trouble with the cache only makes a
load slow again, never wrong or failed."""

from __future__ import annotations

import os
import sys
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import histoinfer
from histoinfer.models import build_server_model, script_cache
from histoinfer.models.checkpoint import CheckpointError, load_checkpoint
from histoinfer.models.script_cache import CACHE_ENV

pytestmark = pytest.mark.timeout(120)


def tiles(n: int) -> torch.Tensor:
    seeded = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (n, 3, 224, 224), generator=seeded, dtype=torch.uint8)


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.pt"))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "scripted"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def test_a_second_load_reads_the_kept_translation_and_answers_alike(
    tiny_checkpoint: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build_server_model("h1", tiny_checkpoint)
    [entry] = entries(cache)
    assert entry.name.startswith(first.checkpoint.sha256)
    assert f"torch{torch.__version__}" in entry.name
    assert f"histoinfer{histoinfer.__version__}" in entry.name

    def no_export_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the .pt2 was deserialized again")

    monkeypatch.setattr(torch.export, "load", no_export_load)
    second = build_server_model("h1", tiny_checkpoint)
    assert second.checkpoint.scripted and second.runner == "TorchScript interpreter"
    assert second.checkpoint.input_dtype == first.checkpoint.input_dtype
    assert second.metadata() == first.metadata()
    batch = tiles(3)
    mode = "predict_with_embedding"
    a, b = first.forward_batch(batch, mode), second.forward_batch(batch, mode)
    assert torch.equal(a.predictions, b.predictions)
    assert torch.equal(a.embedding, b.embedding)


def test_the_cache_works_where_deprecation_warnings_are_errors(
    tiny_checkpoint: Path, cache: Path
) -> None:
    """Regression (a user trial): torch's DeprecationWarning for torch.jit.load/save, raised
    under ``-W error``, was taken for a damaged entry: none was ever written or read."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        build_server_model("h1", tiny_checkpoint)
        assert len(entries(cache)) == 1
        assert build_server_model("h1", tiny_checkpoint).checkpoint.scripted


def test_a_damaged_entry_is_ignored_and_written_again(tiny_checkpoint: Path, cache: Path) -> None:
    build_server_model("h1", tiny_checkpoint)
    [entry] = entries(cache)
    entry.write_bytes(b"not a TorchScript archive")
    model = build_server_model("h1", tiny_checkpoint)  # the slow way, and kept again
    assert model.runner == "TorchScript interpreter"
    assert entries(cache) == [entry] and entry.stat().st_size > 1000
    assert build_server_model("h1", tiny_checkpoint).checkpoint.scripted


def test_an_entry_with_a_flipped_bit_is_not_used(tiny_checkpoint: Path, cache: Path) -> None:
    """Regression (a trial): a bit flipped in a weight of an entry was loaded, and answered
    differently, at every load: torch.jit.load checks no CRC. The zip's own CRCs are checked."""
    first = build_server_model("h1", tiny_checkpoint)
    [entry] = entries(cache)
    with zipfile.ZipFile(entry) as archive:
        weights = max(archive.infolist(), key=lambda info: info.file_size)
        offset = weights.header_offset + 30 + len(weights.filename) + len(weights.extra)
    damaged = bytearray(entry.read_bytes())
    damaged[offset + weights.file_size // 2] ^= 0x10
    entry.write_bytes(bytes(damaged))
    assert script_cache.load(first.checkpoint.sha256) is None
    second = build_server_model("h1", tiny_checkpoint)  # the slow way, and kept again
    batch = tiles(2)
    a, b = first.forward_batch(batch, "predict"), second.forward_batch(batch, "predict")
    assert torch.equal(a.predictions, b.predictions)
    assert script_cache.load(first.checkpoint.sha256) is not None  # written again


def test_off_keeps_nothing(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where the default would be
    model = build_server_model("h1", tiny_checkpoint)
    assert model.runner == "TorchScript interpreter"
    assert not list(tmp_path.rglob("*.pt"))


def test_a_cache_that_cannot_be_written_is_no_error(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(CACHE_ENV, str(blocked))
    model = build_server_model("h1", tiny_checkpoint)
    assert model.runner == "TorchScript interpreter"
    assert model.forward_batch(tiles(1), "embed").embedding is not None


@pytest.mark.skipif(sys.platform == "win32", reason="no mode bits on Windows: not checked")
def test_an_entry_others_may_write_is_not_read(
    tiny_checkpoint: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry stands in for the weights, whose sha256 it only names: one that another user
    could have written is not trusted."""
    build_server_model("h1", tiny_checkpoint)
    [entry] = entries(cache)
    entry.chmod(0o664)
    loads: list[object] = []
    real = torch.export.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        loads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "load", counting)
    build_server_model("h1", tiny_checkpoint)
    assert len(loads) == 1  # the .pt2, not the entry


@pytest.mark.skipif(sys.platform == "win32", reason="plays Windows on a POSIX file's mode")
def test_on_windows_the_mode_everyone_may_write_is_no_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows reports 0o666 for every writable file (access is by ACL): the check refused
    every entry there, so the cache was never read."""
    entry = tmp_path / "entry.pt"
    entry.write_bytes(b"")
    entry.chmod(0o666)
    assert not script_cache._trusted(entry)
    monkeypatch.setattr(os, "name", "nt")
    assert script_cache._trusted(entry)


def test_a_model_that_is_not_scripted_neither_reads_nor_writes_it(
    tiny_checkpoint: Path, cache: Path
) -> None:
    from histoinfer.models.h1 import H1ServerModel

    class Unscripted(H1ServerModel):
        script_program = False

    build_server_model("h1", tiny_checkpoint)  # an entry exists
    model = Unscripted.from_files(tiny_checkpoint)
    assert isinstance(model.checkpoint.program, torch.fx.GraphModule)
    assert model.runner == "fx GraphModule (script_program is False)"
    scripted = load_checkpoint(tiny_checkpoint, script_cache=True)  # by hand, for such a class
    assert scripted.scripted
    with pytest.raises(CheckpointError, match=r"script_program = False.*script_cache=False"):
        Unscripted(scripted, model.assets)


def test_entries_unused_for_a_month_and_abandoned_writes_are_pruned(
    tiny_checkpoint: Path, cache: Path
) -> None:
    """Every new torch or checkpoint leaves an entry (~90 MB for a ViT-S): those no load has
    read for ``UNUSED_DAYS`` go when another is written, as do a killed writer's files."""
    build_server_model("h1", tiny_checkpoint)
    [entry] = entries(cache)
    month = script_cache.UNUSED_DAYS * 86400
    long_ago = time.time() - month - 3600
    name = f"-torch0-histoinfer0-{'a' * 12}.pt"
    stale, recent = cache / f"{'0' * 64}{name}", cache / f"{'1' * 64}{name}"
    dead, writing = cache / ".histoinfer-dead.tmp", cache / ".histoinfer-writing.tmp"
    # The cache may be a folder of the user's own (HISTOINFER_SCRIPT_CACHE): their files stay,
    # however old (a review: a 40-day-old resnet.pt would have gone).
    theirs = [cache / "resnet_trained.pt", cache / ".vim-swap.tmp", cache / f"{'2' * 64}.pt"]
    for path in (stale, recent, dead, writing, *theirs):
        path.write_bytes(b"x")
    for path in (stale, dead, *theirs):
        os.utime(path, (long_ago, long_ago))
    os.utime(recent, (time.time() - month + 3600,) * 2)
    os.utime(entry, (long_ago, long_ago))

    build_server_model("h1", tiny_checkpoint)  # a load reads the entry: it is used again
    assert time.time() - entry.stat().st_mtime < 600
    assert stale.exists()  # nothing was written: nothing pruned
    entry.unlink()
    build_server_model("h1", tiny_checkpoint)  # written again, and the folder pruned
    assert entries(cache) == sorted([entry, recent, theirs[0], theirs[2]])
    assert not dead.exists() and writing.exists() and theirs[1].exists()


def test_an_entry_that_reads_back_differently_is_not_kept(
    tiny_checkpoint: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.jit.load

    def altered(*args: Any, **kwargs: Any) -> Any:
        module = real(*args, **kwargs)
        with torch.no_grad():
            next(iter(module.state_dict().values())).add_(1)
        return module

    monkeypatch.setattr(torch.jit, "load", altered)
    model = build_server_model("h1", tiny_checkpoint)
    assert model.runner == "TorchScript interpreter"
    assert entries(cache) == [] and list(cache.iterdir()) == []


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # the test's own scripting
def test_same_compares_code_and_every_tensor() -> None:
    class Scale(torch.nn.Module):
        def __init__(self, by: float) -> None:
            super().__init__()
            self.by = torch.nn.Parameter(torch.tensor([by]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.by

    class Shift(Scale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.by

    one = torch.jit.script(Scale(1.0))
    assert script_cache._same(one, torch.jit.script(Scale(1.0)))
    assert not script_cache._same(one, torch.jit.script(Scale(2.0)))
    assert not script_cache._same(one, torch.jit.script(Shift(1.0)))
    assert not script_cache._same(one, torch.jit.script(Scale(1.0).double()))
    # Bit for bit: NaN is itself (a model with a NaN weight was never cached), -0.0 is not 0.0.
    nan = torch.jit.script(Scale(float("nan")))
    assert script_cache._same(nan, torch.jit.script(Scale(float("nan"))))
    assert not script_cache._same(torch.jit.script(Scale(0.0)), torch.jit.script(Scale(-0.0)))
