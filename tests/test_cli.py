"""The ``histoinfer`` command: ``export`` and ``metadata``, and errors as one line, no traceback."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from histoinfer.cli import main
from histoinfer.models import CheckpointError


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("histoinfer: error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def test_export_then_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "h1"
    code, out, _ = run(["export", "h1", "--size", "tiny", "--out", str(out_dir)], capsys)
    assert code == 0
    assert "UNTRAINED" in out  # honest about the weights
    checkpoint = out_dir / "model.pt2"
    assert checkpoint.is_file() and (out_dir / "model.json").is_file()
    assert str(checkpoint) in out
    assert not (out_dir / "model-aoti.pt2").exists()

    code, out, _ = run(["metadata", "--checkpoint", str(checkpoint)], capsys)
    assert code == 0
    meta = json.loads(out)
    assert meta["name"] == "h1" and meta["trained"] is False
    assert meta["checkpoint_kind"] == "torch.export"
    assert meta["checkpoint_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    assert meta["output_size"] == len(meta["gene_names"])


def test_metadata_with_assets_elsewhere(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "weights.pt2"
    checkpoint.write_bytes((tiny_dir / "model.pt2").read_bytes())
    code, out, _ = run(
        ["metadata", "--checkpoint", str(checkpoint), "--assets", str(tiny_dir)], capsys
    )
    assert code == 0
    assert json.loads(out)["embedding_size"] > 0


def test_missing_checkpoint_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope" / "model.pt2"
    code, _, err = run(["metadata", "--checkpoint", str(missing)], capsys)
    assert_one_line_error(code, err, str(missing), "not found")


def test_corrupt_checkpoint_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "model.pt2"
    bad.write_text("definitely not a checkpoint")
    code, _, err = run(["metadata", "--checkpoint", str(bad)], capsys)
    assert_one_line_error(code, err, str(bad))


def test_unknown_model_lists_the_available_ones(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["metadata", "--model", "h9", "--checkpoint", str(tiny_checkpoint)], capsys)
    assert_one_line_error(code, err, "'h9'", "h1")


def test_unusable_device_is_one_line(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["metadata", "--checkpoint", str(tiny_checkpoint), "--device", "tpu9"]
    code, _, err = run(argv, capsys)
    assert_one_line_error(code, err, str(tiny_checkpoint), "'tpu9'")


def test_export_never_replaces_a_checkpoint_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder holding the user's trained model must not silently become an untrained one."""
    out_dir = tmp_path / "mine"
    out_dir.mkdir()
    trained = out_dir / "model.pt2"
    trained.write_bytes(b"my trained weights")
    (out_dir / "model.json").write_text('{"trained": true}')
    code, _, err = run(["export", "h1", "--size", "tiny", "--out", str(out_dir)], capsys)
    assert_one_line_error(code, err, str(trained), "model.json", "--force", "untrained")
    assert trained.read_bytes() == b"my trained weights"
    assert (out_dir / "model.json").read_text() == '{"trained": true}'

    alone = tmp_path / "assets-only"
    alone.mkdir()
    (alone / "model.json").write_text("{}")  # any one of the files it would write
    code, _, err = run(["export", "h1", "--size", "tiny", "--out", str(alone)], capsys)
    assert_one_line_error(code, err, "model.json already exists", "replace it")
    assert not (alone / "model.pt2").exists()

    code, out, _ = run(["export", "h1", "--size", "tiny", "--out", str(out_dir), "--force"], capsys)
    assert code == 0 and str(trained) in out
    assert json.loads((out_dir / "model.json").read_text())["trained"] is False
    assert trained.read_bytes() != b"my trained weights"


def test_export_into_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a folder")
    code, _, err = run(["export", "h1", "--size", "tiny", "--out", str(blocker)], capsys)
    assert_one_line_error(code, err, str(blocker))


def test_debug_shows_the_real_exception(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        main(["--debug", "metadata", "--checkpoint", str(tmp_path / "missing.pt2")])


def test_debug_after_the_subcommand_shows_the_real_exception(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        main(["metadata", "--checkpoint", str(tmp_path / "missing.pt2"), "--debug"])


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["export", "h1", "--out", "x"],
        ["metadata", "--checkpoint", "x.pt2"],
        ["serve", "--model", "h1", "--checkpoint", "x.pt2"],  # options added by its module
        ["bench", "--quick"],
    ],
)
def test_every_subcommand_takes_debug_before_or_after_it(argv: list[str]) -> None:
    from histoinfer.cli import _configure_plugin, build_parser

    def parse(words: list[str]) -> argparse.Namespace:
        parser = build_parser()
        assert _configure_plugin(parser, words) is None
        return parser.parse_args(words)

    assert parse(argv).debug is False
    assert parse(["--debug", *argv]).debug is True  # not reset by the subcommand's defaults
    assert parse([*argv, "--debug"]).debug is True
    assert parse(["--debug", *argv, "--debug"]).debug is True


@pytest.mark.parametrize(
    "argv",
    [
        ["metadata", "--checkpoint", "x.pt2"],
        ["serve", "--model", "h1", "--checkpoint", "x.pt2"],
    ],
)
def test_the_commands_that_take_a_registry_key_take_import(argv: list[str]) -> None:
    """``--import MODULE``, repeatable, in order: a user's module registers its model."""
    from histoinfer.cli import _configure_plugin, build_parser

    words = [*argv, "--import", "mine.models", "--import", "other.py"]
    parser = build_parser()
    assert _configure_plugin(parser, words) is None
    assert parser.parse_args(words).imports == ["mine.models", "other.py"]
    parser = build_parser()
    _configure_plugin(parser, argv)
    assert parser.parse_args(argv).imports is None


@pytest.mark.parametrize("argv", [["export", "h1", "--out", "x"], ["demo"]])
def test_the_reference_model_commands_do_not_take_import(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """They build or run the reference h1 only: an imported model could not change that."""
    with pytest.raises(SystemExit) as info:
        main([*argv, "--import", "mine"])
    assert info.value.code == 2 and "--import" in capsys.readouterr().err


def test_bench_takes_import_only_with_a_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    # Its reference sizes are h1's; a model of one's own (--checkpoint) may need a module.
    assert main(["bench", "--quick", "--import", "mine"]) == 2
    assert "--import goes with --checkpoint" in capsys.readouterr().err


def test_an_unknown_key_says_how_to_use_a_model_of_ones_own(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["metadata", "--model", "my-key", "--checkpoint", str(tiny_checkpoint)],
        ["serve", "--model", "my-key", "--checkpoint", str(tiny_checkpoint), "--port", "0"],
    ):
        code, _, err = run(argv, capsys)
        assert_one_line_error(
            code, err, "--model my-key: unknown model 'my-key'", "--import the module"
        )


def test_debug_is_not_recorded_as_a_bench_option() -> None:
    """``histoinfer bench`` writes the command that reproduces its run: --debug is no part."""
    from histoinfer.bench.cli import _canonical_command
    from histoinfer.cli import _configure_plugin, build_parser

    for argv in (["bench", "--quick", "--debug"], ["--debug", "bench", "--quick"]):
        parser = build_parser()
        _configure_plugin(parser, argv)
        assert _canonical_command(parser.parse_args(argv)) == "histoinfer bench --quick"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", "h1", "--size", "gigantic", "--out", "x"])
    assert info.value.code == 2
    assert "gigantic" in capsys.readouterr().err
    assert main([]) == 2  # no command: help, and a failing status


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--port", "70000", "0-65535"),
        ("--max-queue", "0", "at least 1"),
        ("--max-batch-size", "2.5", "not an int"),
        ("--max-wait-ms", "nan", "finite"),
        ("--max-body-mb", "-1", "at least 0.001 (1 KiB)"),
        ("--max-body-mb", "0.0000001", "at least 0.001 (1 KiB)"),  # was 0 bytes: 413 for all
        ("--request-timeout", "0", "more than 0"),
        ("--max-batch-requests", "0", "at least 1"),
        ("--max-batch-calls", "0", "at least 1"),
        ("--graceful-timeout", "-5", "0 or more"),
    ],
)
def test_serve_refuses_bad_option_values_before_starting(
    option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Accepted, each would have served 500s, 413s or 503s to every request."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", "h1", "--checkpoint", "x.pt2", option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and says in err


def test_serve_on_a_port_in_use_is_one_line(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for server in ("uvicorn", "hypercorn"):
            args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint)]
            assert main([*args, "--port", str(port), "--server", server, "--no-warmup"]) == 1
            err = capsys.readouterr().err
            assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


def test_serve_refuses_missing_assets_before_binding(
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused only after the port was open and the model loading: seconds later, exit 1."""
    import socket

    from histoinfer.models import register_model, registry
    from histoinfer.models.h1 import H1ServerModel

    checkpoint = tmp_path / "model.pt2"  # no model.json beside it
    checkpoint.write_bytes(b"")
    with socket.socket() as taken:  # had the address been tried first, "cannot listen on"
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        serve = ["serve", "--checkpoint", str(checkpoint), "--port", port]
        beside = f"model assets {tmp_path / 'model.json'} for model 'h1' not found"
        code, _, err = run([*serve, "--model", "h1"], capsys)
        assert_one_line_error(code, err, beside, "give --assets DIR")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        code, _, err = run([*serve, "--model", "h1", "--assets", str(elsewhere)], capsys)
        assert_one_line_error(code, err, f"model assets {elsewhere / 'model.json'}")
        # Found (--assets), or a class that loads its own: what comes next is the address.
        code, _, err = run([*serve, "--model", "h1", "--assets", str(tiny_dir)], capsys)
        assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}")

        class OwnLoader(H1ServerModel):
            @classmethod
            def from_files(cls, *args: object, **kwargs: object) -> OwnLoader:
                raise NotImplementedError

        monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        register_model("own-loader")(OwnLoader)
        code, _, err = run([*serve, "--model", "own-loader"], capsys)
        assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}")


def test_serve_gives_uvicorn_its_timeouts_as_they_are(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They were rounded up to whole seconds, at least 1: 0.25 s kept connections alive 1 s."""
    import uvicorn

    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *_: configs.append(self.config))
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    assert main([*args, "--keep-alive-timeout", "0.25", "--graceful-timeout", "2.5"]) == 0
    assert configs[0].timeout_keep_alive == 0.25
    assert configs[0].timeout_graceful_shutdown == 2.5
    # A service's log lines say when, uvicorn's as histoinfer's.
    for formatter in configs[0].log_config["formatters"].values():
        assert formatter["fmt"].startswith("%(asctime)s ")
    # The body timeout is the app's: 60 s by default, 0 for none.
    assert configs[0].app.state.histoinfer.body_timeout == 60.0
    assert main([*args, "--body-timeout", "0"]) == 0
    assert configs[1].app.state.histoinfer.body_timeout is None
    # So is the most requests a /batch takes.
    assert configs[0].app.state.histoinfer.max_batch_requests == 4096
    assert main([*args, "--max-batch-requests", "10"]) == 0
    assert configs[2].app.state.histoinfer.max_batch_requests == 10
    # And the most /batch calls in progress at once.
    assert configs[0].app.state.histoinfer.max_batch_calls == 4
    assert main([*args, "--max-batch-calls", "2"]) == 0
    assert configs[3].app.state.histoinfer.max_batch_calls == 2
    # And the most bytes of bodies held at once: 1 GiB, or 16 of the largest if more.
    assert configs[0].app.state.histoinfer.max_held_bytes == 2**30
    assert main([*args, "--max-body-mb", "2", "--max-bodies-mb", "3"]) == 0
    assert configs[4].app.state.histoinfer.max_held_bytes == 3 * 2**20
    assert main([*args, "--max-body-mb", "128"]) == 0
    assert configs[5].app.state.histoinfer.max_held_bytes == 16 * 128 * 2**20


def serve_options(words: list[str]) -> argparse.Namespace:
    from histoinfer.cli import _configure_plugin, build_parser

    parser = build_parser()
    assert _configure_plugin(parser, ["serve", *words]) is None
    return parser.parse_args(["serve", *words])


def test_serve_takes_its_options_from_the_environment_the_command_line_first(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    for name, value in {
        "HISTOINFER_MODEL": "h1, h1-again=h1",
        "HISTOINFER_CHECKPOINT": f"{tiny_checkpoint},{tiny_checkpoint}",
        "HISTOINFER_MAX_QUEUE": "77",
        "HISTOINFER_MAX_WAIT_MS": "2.5",
        "HISTOINFER_NO_WARMUP": "true",
        "HISTOINFER_ACCESS_LOG": "0",
        "HISTOINFER_SERVER": "hypercorn",
        "HISTOINFER_MAX_BATCH_CALLS": "3",
    }.items():
        monkeypatch.setenv(name, value)
    args = serve_options([])
    assert args.model == ["h1", "h1-again=h1"] and args.checkpoint == [tiny_checkpoint] * 2
    assert (args.max_queue, args.max_wait_ms, args.server) == (77, 2.5, "hypercorn")
    assert args.no_warmup is True and args.access_log is False
    assert args.port == 8080  # no variable: the option's own default
    # Given on the command line, an option's value replaces the variable's (a repeated one's
    # values too: not added to the variable's).
    args = serve_options(["--model", "other=h1", "--checkpoint", "x.pt2", "--max-queue", "5"])
    assert args.model == ["other=h1"] and args.checkpoint == [Path("x.pt2")]
    assert args.max_queue == 5 and args.server == "hypercorn"
    # The whole command, from the environment alone.
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *_: configs.append(self.config))
    monkeypatch.setenv("HISTOINFER_SERVER", "uvicorn")
    monkeypatch.setenv("HISTOINFER_PORT", "0")
    assert main(["serve"]) == 0
    state = configs[0].app.state.histoinfer
    assert sorted(state.models) == ["h1", "h1-again"] and state.max_batch_calls == 3


def test_a_variable_is_read_only_where_the_command_line_leaves_its_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review: a bad variable stopped a command that set the option itself, and Kubernetes
    sets HISTOINFER_PORT=tcp://... in every pod of a namespace with a Service so named."""
    monkeypatch.setenv("HISTOINFER_MAX_QUEUE", "0")  # bad, but the command line's is used
    monkeypatch.setenv("HISTOINFER_PORT", "tcp://10.96.0.12:8080")  # a service link: ignored
    monkeypatch.setenv("HISTOINFER_HOST", "")  # empty: unset, as a compose file leaves it
    monkeypatch.setenv("HISTOINFER_LOG_LEVEL", "WARNING")  # as containers spell it
    args = serve_options(["--model", "h1", "--checkpoint", "x.pt2", "--max-queue", "9"])
    assert (args.max_queue, args.port, args.host, args.log_level) == (
        9,
        8080,
        "127.0.0.1",
        "warning",
    )


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_variable_that_sets_nothing_is_warned_of(
    tiny_checkpoint: Path,
    log_format: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An evaluator's misspelt HISTOINFER_MAX_QEUE=4 was ignored unsaid, and HISTOINFER_DEBUG
    looks like --debug's variable but is not read; Kubernetes' service variables (of a
    Service named histoinfer, or histoinfer-x) are no one's mistake. Said once the log is set
    up: said while the options were read, it was plain text in a JSON log (a review)."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *_: None)
    for name in (
        "HISTOINFER_MAX_QEUE",
        "HISTOINFER_DEBUG",
        "HISTOINFER_WHATEVER",
        "HISTOINFER_SERVICE_HOST",
        "HISTOINFER_SERVICE_PORT_HTTP",
        "HISTOINFER_PORT_8080_TCP_ADDR",
        "HISTOINFER_X_SERVICE_HOST",
        "HISTOINFER_X_PORT",
        "HISTOINFER_X_PORT_8080_TCP",
        "HISTOINFER_SCRIPT_CACHE",
    ):
        monkeypatch.setenv(name, "1")
    serve = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    assert main([*serve, "--log-format", log_format]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "not a setting" in line]
    said = [
        "HISTOINFER_DEBUG is not a setting of histoinfer serve (--debug has no variable: give "
        "it on the command line): ignored",
        "HISTOINFER_MAX_QEUE is not a setting of histoinfer serve (did you mean "
        "HISTOINFER_MAX_QUEUE?): ignored",
        "HISTOINFER_WHATEVER is not a setting of histoinfer serve (no option of serve's reads "
        "it): ignored",
    ]
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert [(r["level"], r["message"]) for r in records] == [("WARNING", m) for m in said]
    else:
        assert lines == [f"histoinfer: warning: {m}" for m in said]


def test_serve_says_the_settings_in_force_wherever_they_came_from(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A container's environment is not in its log: the settings line is (an evaluator)."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *_: None)
    monkeypatch.setenv("HISTOINFER_MAX_QUEUE", "77")
    serve = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    assert main([*serve, "--max-wait-ms", "2", "--no-warmup", "--max-body-mb", "128"]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if "settings:" in line]
    assert "--max-queue 77 " in line and "--max-wait-ms 2.0 " in line
    assert "--no-warmup " in line and "--access-log" not in line and "  " not in line
    assert "--max-bodies-mb 2048 " in line  # worked out: 16 of the largest body


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("HISTOINFER_MAX_QUEUE", "0", "must be at least 1"),
        ("HISTOINFER_MAX_WAIT_MS", "soon", "is not a number"),
        ("HISTOINFER_BACKEND", "curio", "must be one of asyncio, trio"),
        ("HISTOINFER_NO_WARMUP", "maybe", "a flag takes 1, true"),
        ("HISTOINFER_MODEL", "h1,,h2", "an empty value"),
    ],
)
def test_serve_refuses_a_bad_variable_naming_it(
    name: str,
    value: str,
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", "h1", "--checkpoint", "x.pt2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err and says in err


def test_serve_refuses_less_room_for_bodies_than_one_body_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    serve = ["serve", "--model", "h1", "--checkpoint", "x.pt2", "--port", "0"]
    code, _, err = run([*serve, "--max-body-mb", "8", "--max-bodies-mb", "4"], capsys)
    assert_one_line_error(code, err, "--max-bodies-mb (4) must be at least --max-body-mb (8)")


@pytest.mark.parametrize("spec", ["a/b=h1", "=h1"])
def test_serve_refuses_a_model_name_that_is_not_a_route(
    spec: str, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", spec, "--checkpoint", str(tiny_checkpoint)]) == 1
    assert "without '/'" in capsys.readouterr().err


def test_serve_refuses_the_model_name_metrics_gives_unserved_paths(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Served as "unknown", its requests and those naming no served model were one series."""
    assert main(["serve", "--model", "unknown=h1", "--checkpoint", str(tiny_checkpoint)]) == 1
    assert "serve it as NAME=h1" in capsys.readouterr().err


def test_serve_refuses_an_unknown_registry_key_before_binding(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["serve", "--model", "h1", "--model", "x=h2", "--checkpoint", str(tiny_checkpoint)]
    code = main([*args, "--checkpoint", str(tiny_checkpoint), "--port", "1"])  # never bound
    assert_one_line_error(code, capsys.readouterr().err, "--model x=h2", "unknown model 'h2'")


@pytest.mark.parametrize("level", ["warning", "error"])
def test_serve_refuses_an_access_log_its_log_level_leaves_out(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str], level: str
) -> None:
    """Both were taken, and no access line was written, with no word of why (a user trial)."""
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--access-log"]
    code = main([*args, "--log-level", level, "--port", "1"])  # never bound
    assert_one_line_error(code, capsys.readouterr().err, f"--log-level {level} leaves out")


@pytest.mark.parametrize(("device", "said"), [("tpu", "not a torch device"), ("cpu:7", "no index")])
def test_serve_refuses_an_unusable_device_before_binding(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str], device: str, said: str
) -> None:
    """It bound the port, and failed seconds later as the model loaded (a user trial)."""
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--device", device]
    code = main([*args, "--port", "1"])  # never bound: port 1 would fail as a privileged port
    assert_one_line_error(code, capsys.readouterr().err, repr(device), said)


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_a_missing_extra_is_named_even_with_options(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not 'unrecognized arguments': the options are the plugin's, which did not import."""
    module = "histoinfer.server.cli" if command == "serve" else "histoinfer.bench.cli"
    monkeypatch.setitem(sys.modules, module, None)  # as if its packages were missing
    for argv in ([command, "--model", "h1", "--port", "8085"], [command, "--help"], [command]):
        extra = "server" if command == "serve" else "bench"
        code, _, err = run(argv, capsys)
        # Installed from a wheel or from a clone: both ways are said (a wheel's user was told
        # only the clone's).
        assert_one_line_error(
            code,
            err,
            f"the '{extra}' extra: pip install 'histoinfer[{extra}]' "
            f"(in a clone: pip install -e '.[{extra}]')",
        )
    # The word as an option's value is not the subcommand: the command runs (and here fails
    # for its own reason).
    code, _, err = run(["metadata", "--checkpoint", command], capsys)
    assert_one_line_error(code, err, f"checkpoint file not found: {command}")


def test_a_package_missing_at_run_time_is_one_line(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "hypercorn.config", None)
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    code = main([*args, "--server", "hypercorn", "--no-warmup"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "pip install 'histoinfer[server]'" in err and "hypercorn" in err


def test_the_server_package_names_its_extra_when_fastapi_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``from histoinfer.server import create_app`` (docs/server.md) on a plain install said
    only "No module named 'fastapi'"; and ``serve`` says the extra once, not twice."""
    for name in [m for m in sys.modules if m.startswith("histoinfer.server")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(ImportError) as info:
        importlib.import_module("histoinfer.server")
    assert str(info.value).startswith(
        "histoinfer.server needs the 'server' extra: pip install 'histoinfer[server]'"
    )
    code, _, err = run(["serve", "--model", "h1", "--port", "8085"], capsys)
    assert_one_line_error(code, err, "No module named 'fastapi'")
    assert err.count("extra") == 1, err


def test_serve_names_each_client_after_its_route(tiny_checkpoint: Path) -> None:
    """One model under two routes: each client's errors and logs say which route."""
    import argparse

    from histoinfer.server.cli import configure, model_sources

    parser = argparse.ArgumentParser()
    configure(parser)
    ckpt = str(tiny_checkpoint)
    args = parser.parse_args(
        ["--model", "fast=h1", "--checkpoint", ckpt, "--model", "slow=h1", "--checkpoint", ckpt]
    )
    sources = model_sources(args)
    for route in ("fast", "slow"):
        client = sources[route]()  # type: ignore[operator]
        with client:
            assert repr(client).startswith(f"<InProcessClient {route!r}")


def test_demo_where_the_cache_cannot_be_written_says_how_to_move_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A container's read-only home: "[Errno 30] Read-only file system" and no hint (a trial).
    (Root writes anywhere; a file where a folder belongs fails the same way for it too.)"""
    from histoinfer import demo

    (tmp_path / "home").write_text("a file, not a folder")
    monkeypatch.setattr(demo, "cache_dir", lambda: tmp_path / "home" / ".cache" / "histoinfer")
    code, _, err = run(["demo", "--size", "tiny", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "cannot build the reference checkpoint in", "XDG_CACHE_HOME")


def test_demo_refuses_a_tile_of_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tile", "0"]) == 1
    assert "--tile must be positive" in capsys.readouterr().err


def test_demo_writes_the_file_it_names_and_records_the_weights(
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from histoinfer import demo
    from histoinfer.models.h1 import reference_assets

    cache = tmp_path / "cache"
    shutil.copytree(tiny_dir, cache / f"h1-{reference_assets('tiny').version}")
    monkeypatch.setattr(demo, "cache_dir", lambda: cache)
    argv = ["demo", "--size", "tiny", "--tile", "224", "--stride", "4096", "--no-progress"]
    code, out, _ = run([*argv, "--out", str(tmp_path / "results" / "run1")], capsys)
    assert code == 0
    written = tmp_path / "results" / "run1.npz"  # numpy's suffix, and the name said is it
    assert f"wrote {written} (" in out
    with np.load(written) as npz:
        assert bool(npz["trained"]) is False
        assert str(npz["model_version"]) == reference_assets("tiny").version
        assert npz["output"].shape == (1, len(npz["gene_names"]))

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, _, err = run([*argv, "--out", str(blocker / "run.npz")], capsys)
    assert_one_line_error(code, err, f"--out {blocker / 'run.npz'}: cannot create its folder")
    # A folder that exists: the default name inside it (it wrote a .npz beside the folder).
    code, out, _ = run([*argv, "--out", str(tmp_path / "results")], capsys)
    assert code == 0 and (tmp_path / "results" / "histoinfer-demo.npz").is_file()
    assert not (tmp_path / "results.npz").exists()
    # A name ending in "/" is a folder too, made if need be (it wrote new.npz).
    code, out, _ = run([*argv, "--out", f"{tmp_path / 'new'}/"], capsys)
    assert code == 0 and (tmp_path / "new" / "histoinfer-demo.npz").is_file()
    # One that cannot be written to fails before the run, not after every tile.
    # (/proc takes no new files, even from root, as CI runs.)
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    code, _, err = run([*argv, "--out", "/proc/run.npz"], capsys)
    assert_one_line_error(code, err, "--out /proc/run.npz: its folder cannot be written")


def test_ctrl_c_while_a_command_imports_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve`` and ``bench`` import their module (seconds) before the command runs: a
    Ctrl-C then printed a whole traceback."""
    import importlib

    from histoinfer import cli

    def interrupted(name: str) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli.main(["serve", "--model", "h1", "--checkpoint", "x.pt2"]) == 130
    assert capsys.readouterr().err == "histoinfer: interrupted\n"


def test_python_dash_m_prints_no_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pt2"
    proc = subprocess.run(
        [sys.executable, "-m", "histoinfer", "metadata", "--checkpoint", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert_one_line_error(proc.returncode, proc.stderr, str(missing))
    assert proc.stdout == ""


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
def test_both_servers_queue_as_many_connections_as_uvicorn(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    """Regression (a soak trial): under hypercorn the listen backlog was its default of 100,
    and a burst of 2,000 connections lost 823 (reset, in no log or metric) where uvicorn,
    with 2048, answered the excess 503."""
    import hypercorn.asyncio
    import uvicorn

    from histoinfer.server.guarded_http import GuardedHttpToolsProtocol

    backlogs: list[int] = []

    async def hypercorn_serve(app: object, config: object, **kwargs: object) -> None:
        backlogs.append(config.backlog)  # type: ignore[attr-defined]

    def uvicorn_run(self: uvicorn.Server, *args: object, **kwargs: object) -> None:
        backlogs.append(self.config.backlog)
        assert self.config.http is GuardedHttpToolsProtocol  # its heads bounded

    monkeypatch.setattr(hypercorn.asyncio, "serve", hypercorn_serve)
    monkeypatch.setattr(uvicorn.Server, "run", uvicorn_run)  # histoinfer's subclass runs it
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    main([*args, "--server", server, "--backend", "asyncio", "--no-warmup"])
    assert backlogs == [2048]


@pytest.mark.skipif(sys.platform == "win32", reason="plays Windows on a POSIX socket module")
def test_the_address_probe_claims_the_port_exclusively_on_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows's SO_REUSEADDR lets a second socket bind a port in use: the probe passed there,
    and the server failed later, after loading its models."""
    import socket

    from histoinfer.server.cli import _probe_option

    assert _probe_option() == socket.SO_REUSEADDR  # a port in TIME_WAIT is free, as to servers
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(socket, "SO_EXCLUSIVEADDRUSE", -5, raising=False)  # Windows's: ~4
    assert _probe_option() == -5
    monkeypatch.delattr(socket, "SO_EXCLUSIVEADDRUSE")
    assert _probe_option() is None  # no option at all, rather than SO_REUSEADDR


def test_hypercorn_on_asyncio_stops_on_a_signal_where_the_loop_cannot_watch_signals(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio on Windows has no add_signal_handler (NotImplementedError): the signal watch
    failed there, and with it `serve --server hypercorn`. Python's own handlers take them."""
    import asyncio
    import signal

    import anyio
    import hypercorn.asyncio

    def unsupported(self: object, *args: object) -> None:
        raise NotImplementedError  # as asyncio's loops on Windows

    before = signal.getsignal(signal.SIGTERM)
    stopped: list[bool] = []

    async def hypercorn_serve(app: object, config: object, **kwargs: Any) -> None:
        with anyio.fail_after(10):
            while signal.getsignal(signal.SIGTERM) is before:  # the watch is not yet on
                await anyio.sleep(0.01)
            signal.raise_signal(signal.SIGTERM)
            await kwargs["shutdown_trigger"]()  # the drain's stop
        stopped.append(True)

    monkeypatch.setattr(asyncio.SelectorEventLoop, "add_signal_handler", unsupported)
    monkeypatch.setattr(hypercorn.asyncio, "serve", hypercorn_serve)
    args = ["serve", "--model", "h1", "--checkpoint", str(tiny_checkpoint), "--port", "0"]
    assert main([*args, "--server", "hypercorn", "--backend", "asyncio", "--no-warmup"]) == 0
    assert stopped == [True]
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back
