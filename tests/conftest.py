"""Shared fixtures: both anyio backends, and one tiny reference checkpoint per session."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from histoinfer.clients.inprocess import InProcessClient
from histoinfer.models import ServerModel, build_server_model, registry
from histoinfer.models.h1 import export_reference_h1
from histoinfer.models.script_cache import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def script_cache_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TorchScript translations cached for this session alone (models/script_cache.py): the
    servers the tests start read them (~0.1 s a load, not ~4), and nothing is written to the
    user's own cache. Set in the environment, so that child processes use it too."""
    folder = tmp_path_factory.mktemp("scripted")
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(folder)
    yield folder
    if before is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on asyncio and on trio."""
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("h1-tiny")
    export_reference_h1("tiny", out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_dir: Path) -> Path:
    return tiny_dir / "model.pt2"


@pytest.fixture
def copy_of_tiny(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint and assets, free to damage."""
    out = tmp_path / "copy"
    shutil.copytree(tiny_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path) -> ServerModel:
    """One loaded tiny model, shared: after loading, a ServerModel is safe to share (its only
    state, the CPU input buffer, is leased to one forward pass at a time)."""
    return build_server_model("h1", tiny_checkpoint)


@pytest.fixture
def client(tiny_model: ServerModel) -> Iterator[InProcessClient]:
    """A dynamic-batching client, closed after the test."""
    with InProcessClient(tiny_model, max_batch_size=16, max_wait_ms=5.0) as c:
        yield c


@pytest.fixture
def explicit_client(tiny_model: ServerModel) -> Iterator[InProcessClient]:
    with InProcessClient(tiny_model, max_batch_size=8, dynamic_batching=False) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model: ServerModel) -> Iterator[InProcessClient]:
    """Explicit batching (no scheduler): the expected outputs, one client per test module."""
    with InProcessClient(tiny_model, dynamic_batching=False) as c:
        yield c


@pytest.fixture(autouse=True)
def _histoinfer_log_level() -> Iterator[None]:
    """An in-process ``histoinfer serve`` (tests/test_cli.py) sets the histoinfer logger's
    level for the process; put it back, so no test sees another's level."""
    logger = logging.getLogger("histoinfer")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture
def private_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test registers into a copy of the model registry, and the ``usermodels_*`` modules it
    imports (``--import``) are forgotten after it."""
    registry.available_models()  # the built-ins in, before the copy
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_SHADOWS_CHECKED", set())
    monkeypatch.setattr(registry, "_FROM_ENTRY_POINTS", set())
    monkeypatch.setattr(sys, "path", list(sys.path))  # --import may add the current directory
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("usermodels_"):
            del sys.modules[name]
