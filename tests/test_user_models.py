"""A model of the user's own: what ``register_model`` accepts (and refuses, at the decorator),
the ``histoinfer.models`` entry points, and ``--import MODULE`` for ``serve`` and ``metadata``."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import socket
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from histoinfer.cli import CommandError, main
from histoinfer.errors import InvalidRequestError
from histoinfer.models import (
    available_models,
    build_server_model,
    register_model,
    registry,
)
from histoinfer.models.h1 import H1ServerModel
from histoinfer.models.registry import UnknownModelError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("private_registry")]


def one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("histoinfer: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


# -- register_model checks what it is given (F12) --------------------------------------------


class EmbedOnly(H1ServerModel):
    modes = ("embed",)


def test_a_valid_model_is_registered() -> None:
    assert register_model("embed-only")(EmbedOnly) is EmbedOnly
    assert registry.model_class("embed-only") is EmbedOnly
    assert "embed-only" in available_models()


@pytest.mark.parametrize("key", [1, None, b"h2", ("a",)])
def test_a_key_that_is_not_a_str_is_refused_and_lookups_still_work(key: Any) -> None:
    """Registered, a key of another type made every lookup's sorting raise TypeError."""
    with pytest.raises(TypeError, match=r"model key must be a str .*got "):
        register_model(key)(EmbedOnly)
    assert available_models() == sorted(available_models())
    assert all(isinstance(k, str) for k in available_models())
    with pytest.raises(InvalidRequestError, match="unknown model 'h9'; available models: "):
        registry.model_class("h9")


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("", "must not be empty"),
        ("a/b", "'/'"),
        ("my model", "' '"),
        ("tab\tkey", "'\\\\t'"),
        ("line\n", "'\\\\n'"),
    ],
)
def test_a_key_that_cannot_be_a_route_is_refused(key: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        register_model(key)(EmbedOnly)
    assert "route" in str(info.value) or "empty" in str(info.value)
    assert key not in registry._REGISTRY


@pytest.mark.parametrize(
    "thing",
    [torch.nn.Linear, int, lambda: None, object()],
    ids=["torch-module", "int", "function", "instance"],
)
def test_what_is_not_a_server_model_class_is_refused(thing: Any) -> None:
    with pytest.raises(TypeError, match=r"is not a subclass of histoinfer\.ServerModel"):
        register_model("not-a-model")(thing)
    assert "not-a-model" not in available_models()


@pytest.mark.parametrize(
    ("modes", "error", "says"),
    [
        ("embed", TypeError, r"modes must be a tuple of modes.*got str 'embed'"),
        (None, TypeError, r"modes must be a tuple"),
        ((), ValueError, r"modes is empty: the model would serve nothing"),
        (("embed", "segment"), ValueError, r"unknown mode\(s\) 'segment'; the modes are 'pred"),
        (("predict", "predict"), ValueError, r"names 'predict' twice"),
    ],
)
def test_modes_are_checked_at_the_decorator(modes: Any, error: type[Exception], says: str) -> None:
    """Before, each failed only at load (a raw pydantic ValidationError), or, empty, loaded a
    model that served nothing."""
    cls = type("Odd", (H1ServerModel,), {"modes": modes})
    with pytest.raises(error, match=says) as info:
        register_model("odd")(cls)
    assert "register_model('odd')" in str(info.value)
    assert "odd" not in available_models()


def test_modes_may_be_a_list() -> None:
    """As before the checks (the class attribute is typed a tuple; a list worked)."""
    cls = type("ListModes", (H1ServerModel,), {"modes": ["embed"]})
    try:
        register_model("list-modes")(cls)
        assert "list-modes" in available_models()
    finally:
        registry._REGISTRY.pop("list-modes", None)


# -- histoinfer.models entry points -----------------------------------------------------------


def write_module(directory: Path, body: str, name: str | None = None) -> str:
    """A module in ``directory`` with a unique name (forgotten after the test)."""
    name = name or f"usermodels_{uuid.uuid4().hex[:10]}"
    (directory / f"{name}.py").write_text(textwrap.dedent(body))
    return name


USER_MODULE = """
    from histoinfer.models.h1 import H1ServerModel

    class Mine(H1ServerModel):
        modes = ("embed",)
"""

REGISTERING_MODULE = """
    from histoinfer import register_model
    from histoinfer.models.h1 import H1ServerModel

    @register_model("my-key")
    class Mine(H1ServerModel):
        modes = ("embed",)
"""


def declare(monkeypatch: pytest.MonkeyPatch, entries: dict[str, str]) -> None:
    """As if installed packages declared ``[project.entry-points."histoinfer.models"]``
    ``KEY = "module:Class"`` for each of ``entries``: ``importlib.metadata.entry_points``
    answers them for the group (and as before for any other)."""
    group = "histoinfer.models"  # the documented group
    ours = importlib.metadata.EntryPoints(
        importlib.metadata.EntryPoint(key, value, group) for key, value in entries.items()
    )
    real = importlib.metadata.entry_points

    def entry_points(**params: Any) -> Any:
        if params.get("group") == group:
            return ours.select(**params)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module (not imported yet) whose ``Mine`` is registered by nothing."""
    name = write_module(tmp_path, USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_an_entry_point_is_listed_and_loaded_only_when_asked_for(
    user_module: str, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Path
) -> None:
    declare(monkeypatch, {"ep-model": f"{user_module}:Mine"})
    assert "ep-model" in available_models() and "h1" in available_models()
    assert user_module not in sys.modules  # listed, not imported

    cls = registry.model_class("ep-model")
    assert cls.__module__ == user_module and cls.__name__ == "Mine"
    assert registry.model_class("ep-model") is cls  # registered: loaded once
    model = build_server_model("ep-model", tiny_checkpoint)
    assert type(model) is cls and model.metadata().modes == ["embed"]


def test_an_entry_point_to_a_class_its_module_registers_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = write_module(tmp_path, REGISTERING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    declare(monkeypatch, {"my-key": f"{name}:Mine"})
    assert registry.model_class("my-key").__module__ == name


def test_an_entry_point_for_a_key_registered_otherwise_is_said_to_be_unused(
    user_module: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It was ignored silently: a package declaring ``h1`` got the built-in model."""
    declare(monkeypatch, {"h1": f"{user_module}:Mine"})
    with caplog.at_level(logging.WARNING, logger="histoinfer.models.registry"):
        assert registry.model_class("h1") is H1ServerModel
        assert registry.model_class("h1") is H1ServerModel  # said once
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith(f"model 'h1': the entry point '{user_module}:Mine' (histoinfer.models")
    assert "is not used: 'h1' is histoinfer's own in this process" in said
    assert "histoinfer.models.h1:H1ServerModel" in said and "another key" in said
    assert user_module not in sys.modules  # not imported to find out


def test_an_entry_point_in_use_is_not_said_to_be_unused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry point naming its class where a package re-exports it (``pkg:Mine``, defined
    in ``pkg.impl``) is the one in use: looked up again (``serve`` looks twice), it was
    said to be unused."""
    package = tmp_path / "reexporting"
    package.mkdir()
    (package / "impl.py").write_text(textwrap.dedent(USER_MODULE))
    (package / "__init__.py").write_text("from .impl import Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    declare(monkeypatch, {"ep-model": "reexporting:Mine"})
    with caplog.at_level(logging.WARNING, logger="histoinfer.models.registry"):
        first = registry.model_class("ep-model")
        assert registry.model_class("ep-model") is first
    assert first.__module__ == "reexporting.impl"
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("usermodels_nowhere:Mine", "ModuleNotFoundError: No module named 'usermodels_nowhere'"),
        ("torch.nn:Linear", "is not a subclass of histoinfer.ServerModel"),
        ("{module}:Missing", "AttributeError"),
        ("{module}:Mine", "ValueError: register_model: model key 'bad key' contains ' '"),
    ],
    ids=["no-module", "not-a-server-model", "no-such-class", "bad-key"],
)
def test_a_broken_entry_point_breaks_only_its_own_key(
    value: str,
    says: str,
    user_module: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "bad key" if "bad key" in says else "broken"
    declare(monkeypatch, {"ep-model": f"{user_module}:Mine", key: value.format(module=user_module)})
    # Listing, the built-ins and the other entry point are unharmed.
    assert {"h1", "ep-model", key} <= set(available_models())
    assert registry.model_class("h1") is H1ServerModel
    assert registry.model_class("ep-model").__name__ == "Mine"
    with pytest.raises(registry.ModelEntryPointError) as info:
        registry.model_class(key)
    message = str(info.value)
    assert f"model {key!r}: its entry point {value.format(module=user_module)!r}" in message
    assert "(histoinfer.models)" in message and "failed to load" in message and says in message
    assert isinstance(info.value, registry.UnknownModelError)  # what callers already catch
    assert info.value.__cause__ is not None  # the traceback, for --debug
    with pytest.raises(registry.ModelEntryPointError):  # asked again: reported again
        registry.model_class(key)


def test_a_key_declared_twice_differently_is_refused_naming_both(
    user_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = "histoinfer.models"  # the documented group
    ours = importlib.metadata.EntryPoints(
        [
            importlib.metadata.EntryPoint("twice", f"{user_module}:Mine", group),
            importlib.metadata.EntryPoint("twice", "torch.nn:Linear", group),
        ]
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **p: ours.select(**p))
    with pytest.raises(registry.ModelEntryPointError, match="several") as info:
        registry.model_class("twice")
    assert f"{user_module}:Mine" in str(info.value) and "torch.nn:Linear" in str(info.value)


def test_unreadable_entry_points_do_not_break_the_built_ins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(**params: Any) -> Any:
        raise RuntimeError("a distribution's metadata is corrupt")

    monkeypatch.setattr(importlib.metadata, "entry_points", broken)
    assert "h1" in available_models()
    with pytest.raises(registry.UnknownModelError, match="unknown model 'h9'"):
        registry.model_class("h9")


def test_metadata_uses_an_entry_point_without_import(
    user_module: str,
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    declare(monkeypatch, {"ep-model": f"{user_module}:Mine"})
    assert main(["metadata", "--model", "ep-model", "--checkpoint", str(tiny_checkpoint)]) == 0
    assert json.loads(capsys.readouterr().out)["modes"] == ["embed"]


def test_serve_names_a_broken_entry_point_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    declare(monkeypatch, {"broken": "usermodels_nowhere:Mine"})
    code = main(["serve", "--model", "x=broken", "--checkpoint", str(tiny_checkpoint)])
    one_line_error(
        code,
        capsys.readouterr().err,
        "--model x=broken: model 'broken': its entry point 'usermodels_nowhere:Mine'",
        "ModuleNotFoundError",
    )


# -- --import MODULE ----------------------------------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory is ``tmp_path``, which is not on sys.path (as for a console
    script, whose sys.path starts with its bin directory)."""
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path) not in sys.path
    return tmp_path


def test_metadata_imports_a_module_from_the_current_directory(
    in_tmp: Path, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = write_module(in_tmp, REGISTERING_MODULE)
    argv = ["metadata", "--model", "my-key", "--checkpoint", str(tiny_checkpoint)]
    code, _ = main(argv), capsys.readouterr()
    assert code == 1  # not registered without the import
    assert main([*argv, "--import", name]) == 0
    assert json.loads(capsys.readouterr().out)["modes"] == ["embed"]


def test_metadata_imports_a_package_module_and_a_py_file(
    in_tmp: Path, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = in_tmp / "usermodels_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_module(package, REGISTERING_MODULE, name="models")
    elsewhere = in_tmp / "elsewhere"
    elsewhere.mkdir()
    # A .py file that imports the module beside it (its folder is on sys.path, as for python
    # FILE), and registers a second key.
    write_module(elsewhere, "ANSWER = 42\n", name="usermodels_helper")
    file_body = """
        from usermodels_helper import ANSWER
        from histoinfer import register_model
        from histoinfer.models.h1 import H1ServerModel

        assert ANSWER == 42

        @register_model("from-file")
        class FromFile(H1ServerModel):
            modes = ("predict",)
    """
    file_module = write_module(elsewhere, file_body)
    argv = ["metadata", "--checkpoint", str(tiny_checkpoint)]
    imports = ["--import", "usermodels_pkg.models", "--import", f"elsewhere/{file_module}.py"]
    assert main([*argv, "--model", "my-key", *imports]) == 0
    assert json.loads(capsys.readouterr().out)["modes"] == ["embed"]
    assert main([*argv, "--model", "from-file", *imports]) == 0  # imported once: not refused
    assert json.loads(capsys.readouterr().out)["modes"] == ["predict"]
    assert sys.modules[file_module].__file__ == str(elsewhere / f"{file_module}.py")


def test_serve_imports_the_module_before_looking_the_key_up(
    in_tmp: Path, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = write_module(in_tmp, REGISTERING_MODULE)
    with socket.socket() as taken:  # the key resolves; the port in use ends it before serving
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = ["serve", "--model", "mine=my-key", "--checkpoint", str(tiny_checkpoint)]
        args += ["--port", port, "--no-warmup"]
        one_line_error(main(args), capsys.readouterr().err, "unknown model 'my-key'", "--import")
        code = main([*args, "--import", name])
    one_line_error(code, capsys.readouterr().err, f"cannot listen on 127.0.0.1:{port}")


def test_serve_builds_the_imported_class(in_tmp: Path, tiny_checkpoint: Path) -> None:
    from histoinfer.cli import _configure_plugin, build_parser, import_modules
    from histoinfer.server.cli import model_sources

    name = write_module(in_tmp, REGISTERING_MODULE)
    argv = ["serve", "--import", name, "--model", "my-key", "--checkpoint", str(tiny_checkpoint)]
    parser = build_parser()
    assert _configure_plugin(parser, argv) is None
    args = parser.parse_args(argv)
    assert args.imports == [name]
    import_modules(args.imports)
    client = model_sources(args)["my-key"]()  # type: ignore[operator]
    with client:
        assert json.loads(client.metadata())["modes"] == ["embed"]


@pytest.mark.parametrize("command", ["metadata", "serve"])
@pytest.mark.parametrize(
    ("module", "body", "says"),
    [
        ("usermodels_missing", None, "ModuleNotFoundError: No module named 'usermodels_missing'"),
        ("usermodels_raises", "raise RuntimeError('no GPU\\nhere')", "RuntimeError: no GPU here"),
        ("usermodels_syntax", "def (:\n", "SyntaxError"),
        ("usermodels_badkey", "from histoinfer import register_model\nregister_model(1)", ""),
        ("usermodels_missing.py", None, "no such file"),
        ("usermodels_raises.py", "raise ImportError('needs timm')", "ImportError: needs timm"),
    ],
)
def test_a_module_that_fails_to_import_is_one_line_naming_it(
    command: str,
    module: str,
    body: str | None,
    says: str,
    in_tmp: Path,
    tiny_checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if body is not None:
        (in_tmp / (module if module.endswith(".py") else f"{module}.py")).write_text(body)
    if module == "usermodels_badkey":
        says = "TypeError: register_model: a model key must be a str"
    model = ["--model", "h1"] if command == "metadata" else ["--model", "h1", "--port", "0"]
    argv = [command, *model, "--checkpoint", str(tiny_checkpoint), "--import", module]
    line = one_line_error(main(argv), capsys.readouterr().err, f"--import {module}", says)
    # Not mistaken for a missing extra (an ImportError from the command's own packages).
    assert "extra" not in line


def test_debug_shows_the_import_failure_itself(in_tmp: Path, tiny_checkpoint: Path) -> None:
    (in_tmp / "usermodels_raises.py").write_text("raise RuntimeError('no GPU here')")
    argv = ["metadata", "--checkpoint", str(tiny_checkpoint), "--import", "usermodels_raises"]
    with pytest.raises(CommandError) as info:
        main([*argv, "--debug"])
    assert isinstance(info.value.__cause__, RuntimeError)  # in the traceback printed


def test_a_py_file_that_fails_is_not_left_half_imported(
    in_tmp: Path, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file that fails half-way is not left in sys.modules: fixed and given again, it runs."""
    path = in_tmp / "usermodels_half.py"
    path.write_text("raise RuntimeError('first try')")
    argv = ["metadata", "--checkpoint", str(tiny_checkpoint), "--import", str(path)]
    assert main(argv) == 1 and "usermodels_half" not in sys.modules
    capsys.readouterr()
    path.write_text(textwrap.dedent(REGISTERING_MODULE))
    assert main([*argv, "--model", "my-key"]) == 0


def test_a_file_named_like_an_imported_module_is_refused(
    in_tmp: Path, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (in_tmp / "json.py").write_text("raise RuntimeError('must not run')")
    argv = ["metadata", "--checkpoint", str(tiny_checkpoint), "--import", "json.py"]
    one_line_error(main(argv), capsys.readouterr().err, "'json' is already imported", "rename")


def test_a_misspelt_key_is_answered_with_the_nearest_one(tiny_checkpoint: Path) -> None:
    # A user trial: --model-key mycnn, with its module registering my-cnn.
    @register_model("my-cnn")
    class MyCnn(H1ServerModel):
        pass

    with pytest.raises(UnknownModelError) as info:
        build_server_model("mycnn", tiny_checkpoint)
    assert "unknown model 'mycnn' (did you mean 'my-cnn'?); available models:" in str(info.value)
    with pytest.raises(UnknownModelError) as far:
        build_server_model("zz", tiny_checkpoint)
    assert "did you mean" not in str(far.value)
