"""The ``histoinfer`` command: ``demo``, ``export``, ``metadata``, ``serve`` and ``bench``.

Errors print one clear line and exit non-zero, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import InferenceError
from .extras import install_hint

__all__ = ["main"]

# Subcommands that live with what they run, imported only when used (so `histoinfer export`
# never imports a web framework): name -> (module, help).
_PLUGGED = {
    "serve": ("histoinfer.server.cli", "run the FastAPI microservice"),
    "bench": ("histoinfer.bench.cli", "measure throughput and latency (see docs/benchmarks.md)"),
}


class CommandError(Exception):
    """A user-facing failure: printed as one line."""


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="build a reference checkpoint (seeded, UNTRAINED weights) and its assets",
        description="Write DIR/model.pt2 (torch.export), DIR/model.json and, with --aoti, "
        "DIR/model-aoti.pt2 (AOTInductor). The weights are seeded and untrained: the real h1 "
        "architecture and file format, not a trained model.",
    )
    p.add_argument("model", choices=["h1"], help="registry key")
    p.add_argument(
        "--size",
        choices=["tiny", "small", "large"],
        default="tiny",
        help="reference model size (default: %(default)s)",
    )
    p.add_argument("--aoti", action="store_true", help="also compile an AOTInductor package")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the program's precision (default float32; bfloat16 is ~1.3-1.5x faster on CPUs "
        "with AMX, and on GPUs; float16 is not faster on CPUs)",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the checkpoint files already in DIR (refused without it: DIR may hold "
        "a trained model)",
    )
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from .models.assets import ASSETS_FILE
    from .models.h1 import AOTI_CHECKPOINT_FILE, CHECKPOINT_FILE, export_reference_h1

    names = [CHECKPOINT_FILE, ASSETS_FILE] + ([AOTI_CHECKPOINT_FILE] if args.aoti else [])
    taken = [str(args.out / name) for name in names if (args.out / name).exists()]
    if taken and not args.force:
        # An untrained reference written over a user's own checkpoint (and its model.json,
        # then "trained": false) would be silent data loss.
        raise CommandError(
            f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''}: not replaced "
            f"by a reference checkpoint with untrained weights; choose another --out, or pass "
            f"--force to replace {'it' if len(taken) == 1 else 'them'}"
        )
    precision = "" if args.dtype == "float32" else f", {args.dtype}"
    print(f"exporting h1 ({args.size}{precision}) with seeded, UNTRAINED weights to {args.out} ...")
    result = export_reference_h1(args.size, args.out, aoti=args.aoti, dtype=args.dtype)
    print(f"wrote {result.checkpoint}")
    if result.aoti_checkpoint is not None:
        print(f"wrote {result.aoti_checkpoint}")
    print(f"wrote {result.assets}")
    print(f"done in {result.seconds:.1f} s (reference checkpoint: untrained, not for biology)")
    return 0


def add_import_option(parser: argparse.ArgumentParser) -> None:
    """``--import MODULE``, for a command that looks up a registry key (``metadata``,
    ``serve``): the module that registers a model of the user's own is imported first."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=None,
        metavar="MODULE",
        help="import MODULE first: a module that registers a model with "
        "@histoinfer.register_model, by dotted name (found from the current directory, as "
        "with python -m) or as a path to a .py file; repeatable",
    )


def import_modules(names: Sequence[str] | None) -> None:
    """Import each ``--import`` module, in order; one that fails is a :class:`CommandError`
    naming it and its exception (chained to it, for ``--debug``'s traceback)."""
    for name in names or ():
        try:
            _import_one(name)
        except CommandError:
            raise
        except Exception as exc:
            why = " ".join(str(exc).split())
            raise CommandError(
                f"--import {name} failed: {type(exc).__name__}{': ' + why if why else ''}"
            ) from exc


def _import_one(name: str) -> None:
    importlib.invalidate_caches()  # a module written since this process started is found
    if name.endswith(".py"):
        _import_file(name)
        return
    # As with `python -m`: modules in the current directory are importable (a console
    # script's sys.path starts with its own bin directory instead).
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    importlib.import_module(name)


def _import_file(name: str) -> None:
    """Import the file ``name`` as the module named after its stem, with its directory on
    ``sys.path`` (as ``python FILE`` has it), so it can import the modules beside it."""
    import importlib.util

    path = Path(name).resolve()
    if not path.is_file():
        raise CommandError(f"--import {name}: no such file")
    module_name = path.stem
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        loaded_from = getattr(loaded, "__file__", None)
        if loaded_from is not None and Path(loaded_from).resolve() == path:
            return  # given twice, or imported already by another --import
        raise CommandError(
            f"--import {name}: a module named {module_name!r} is already imported "
            f"(from {loaded_from or 'the interpreter'}); rename the file"
        )
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has one
        raise CommandError(f"--import {name}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    sys.modules[module_name] = module  # as an import does: the module can import itself
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise


def unknown_model(option: str, exc: Exception) -> CommandError:
    """An unknown registry key, with how to use a model of one's own (ModelEntryPointError,
    a key declared but broken, says what broke instead)."""
    from .models.registry import ModelEntryPointError

    hint = ""
    if not isinstance(exc, ModelEntryPointError):
        hint = " (a model of your own: --import the module that registers it)"
    return CommandError(f"{option}: {exc}{hint}")


def _add_metadata(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("metadata", help="print a checkpoint's metadata as JSON")
    p.add_argument("--model", default="h1", help="registry key (default: h1)")
    p.add_argument("--checkpoint", type=Path, required=True, help="path to the .pt2 file")
    p.add_argument("--assets", type=Path, default=None, help="assets dir (default: beside it)")
    p.add_argument(
        "--device", default="cpu", help="torch device to load it on (default: %(default)s)"
    )
    add_import_option(p)
    p.set_defaults(func=_cmd_metadata)


def _cmd_metadata(args: argparse.Namespace) -> int:
    from .models.registry import UnknownModelError, model_class

    import_modules(args.imports)
    try:
        cls = model_class(args.model)
    except UnknownModelError as exc:
        raise unknown_model(f"--model {args.model}", exc) from exc
    model = cls.from_files(args.checkpoint, device=args.device, assets_dir=args.assets)
    print(json.dumps(model.metadata().model_dump(mode="json"), indent=2))
    return 0


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job on the built-in default: tiles from a real tissue image -> "
        "gene predictions and embeddings (NPZ)",
    )
    p.add_argument(
        "--out",
        default="histoinfer-demo.npz",  # a str: Path would drop a trailing "/" (a folder)
        help="NPZ to write, or a folder to write histoinfer-demo.npz in (default: "
        "histoinfer-demo.npz)",
    )
    p.add_argument(
        "--size",
        choices=["tiny", "small"],
        default="small",
        help="reference model (default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument(
        "--backend",
        choices=["asyncio", "trio"],
        default="asyncio",
        help="event loop the tiles are sent on (default: %(default)s)",
    )
    p.add_argument("--tile", type=int, default=112, help="tile side in image pixels (default: 112)")
    p.add_argument("--stride", type=int, default=56, help="step between tiles (default: 56)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bar (shown only when stderr is a terminal and tqdm is installed)",
    )
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(
        out=args.out,
        size=args.size,
        device=args.device,
        backend=args.backend,
        tile=args.tile,
        stride=args.stride,
        progress=not args.no_progress,
    )


def _add_plugged(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, module: str, help: str
) -> None:
    p = sub.add_parser(name, help=help)

    def run(args: argparse.Namespace) -> int:
        try:
            plugin = importlib.import_module(module)
        except ImportError as exc:
            raise CommandError(_missing(name, exc)) from None
        run_plugin: Callable[[argparse.Namespace], int] = plugin.run
        return run_plugin(args)

    p.set_defaults(func=run, _plugin=module)


_DEBUG_HELP = "show tracebacks and debug logs"


class _DebugAfterCommand(argparse.Action):
    """``--debug`` given after the subcommand: sets the global ``debug``, and nothing else.

    It has no default: a subcommand's defaults overwrite the global options' values, so a
    default of False here would undo ``histoinfer --debug export ...``. It has no ``dest``
    either, so code that lists a subcommand's options (``histoinfer bench`` records the
    command that reproduces its run) does not take it for one of them.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(
            option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, help=help
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        namespace.debug = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="histoinfer",
        description="Computational-pathology tile models (gene expression, embeddings) "
        "in-process or as a microservice, with dynamic batching on asyncio and trio.",
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    _add_export(sub)
    _add_metadata(sub)
    for name, (module, help_text) in _PLUGGED.items():
        _add_plugged(sub, name, module, help_text)
    # `histoinfer export ... --debug` as well as `histoinfer --debug export ...`: the plugged
    # commands get it here too, before their modules add their own options.
    for command_parser in sub.choices.values():
        command_parser.add_argument("--debug", action=_DebugAfterCommand, help=_DEBUG_HELP)
    return parser


#: the extra that installs what a subcommand imports
_EXTRAS = {"serve": "server", "bench": "bench", "demo": "demo"}


def _configure_plugin(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """Let a plugged subcommand add its own options (its module is imported only now); what
    is missing to run it, if its module cannot be imported (its options are unknown then, and
    argparse would only say they are not recognized)."""
    # The subcommand is the first word that is not an option (the global options take no
    # value): "export --out serve" names a folder, not the serve command.
    command = next((word for word in argv if not word.startswith("-")), None)
    for name, (module, _) in _PLUGGED.items():
        if name == command:
            try:
                plugin = importlib.import_module(module)
            except ImportError as exc:
                return _missing(name, exc)
            sub_action = next(
                a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            )
            plugin.configure(sub_action.choices[name])
            return None
    return None


def _missing(command: str, exc: ImportError) -> str:
    extra = _EXTRAS.get(command, "dev")
    # The module's name alone: histoinfer.server's own ImportError names the extra too.
    missing = (
        f"No module named {exc.name!r}"
        if isinstance(exc, ModuleNotFoundError) and exc.name
        else str(exc)
    )
    return f"'histoinfer {command}' needs the '{extra}' extra: {install_hint(extra)} ({missing})"


def _version() -> str:
    from . import __version__

    return f"histoinfer {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        missing = _configure_plugin(parser, argv)  # imports the command's module: seconds
    except KeyboardInterrupt:
        print("histoinfer: interrupted", file=sys.stderr)
        return 130
    if missing is not None:
        print(f"histoinfer: error: {missing}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        print("histoinfer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `histoinfer metadata ... | head`: the reader left; that is not an error of ours.
        # Point stdout at devnull so the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ImportError as exc:  # an optional package the command needs (uvicorn, hypercorn)
        if args.debug:
            raise
        print(f"histoinfer: error: {_missing(args.command, exc)}", file=sys.stderr)
        return 1
    except (CommandError, InferenceError, OSError, ValueError) as exc:
        if args.debug:
            raise
        print(f"histoinfer: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
