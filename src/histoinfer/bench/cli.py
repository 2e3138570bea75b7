"""``histoinfer bench``: the options, and the run. Plugged into ``histoinfer.cli``.

``configure(parser)`` adds the options to the ``bench`` subcommand's parser; ``run(args)`` runs
the suites and writes ``report.json``, ``report.md`` and ``report.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..cli import CommandError, add_import_option
from ..errors import InferenceError
from ..schema import MODES

__all__ = ["UsageError", "configure", "main", "run"]

SUITES = ("throughput", "overhead", "latency", "profile")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _whole(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what} of at least {least}, got {text!r}")
    return value


def _count(text: str) -> int:
    """A whole number of at least 1 (tiles, rounds, a batch size)."""
    return _whole(text, 1, "a number")


def _seed(text: str) -> int:
    return _whole(text, 0, "a seed")


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of milliseconds, got {text!r}"
        ) from None
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


class UsageError(ValueError):
    """Options that make no sense together: one line, exit status 2 (as argparse's)."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``histoinfer bench``'s options to its subparser."""
    # Names only: importing the paths or the models would load torch (~5 s) for --help too.
    from .names import PATH_NAMES, REFERENCE_DTYPES

    parser.description = (
        "Sweep concurrency over every path a tile can take (raw forward, explicit batches, "
        "dynamic batching on asyncio and trio, batch size 1, sync threads, HTTP loopback, "
        "external batchers), measure the scheduler alone and a lone request's latency, and "
        "write report.json, report.md and report.png. Ratios are medians of interleaved "
        "rounds. See docs/benchmarks.md."
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer levels, tiles, rounds (<2 min on 2 quiet cores)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output directory (default: %(default)s)",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="also run the small (ViT-S) model: slower; ignored when --models is given",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="PATH",
        help="measure a model of your own instead of the reference sizes: its .pt2, with "
        "model.json beside it, as 'histoinfer serve --checkpoint' takes it; bodies at its tile "
        "size, only the modes it serves, targets not evaluated (not with --models, --small, "
        "--dtype)",
    )
    parser.add_argument(
        "--model-key",
        default=None,
        metavar="KEY",
        help="with --checkpoint: the registry key of its model class (default: h1)",
    )
    parser.add_argument(
        "--assets",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --checkpoint: the folder of its model.json (default: beside it)",
    )
    add_import_option(parser)  # serve's --import, said as serve says it, and where it applies
    [imports] = [action for action in parser._actions if action.dest == "imports"]
    imports.help = f"{imports.help}; with --checkpoint, imported in every bench process too"
    parser.add_argument(
        "--models",
        type=_names,
        default=None,
        help="reference model sizes to run, e.g. tiny,small (default: tiny)",
    )
    parser.add_argument(
        "--paths",
        type=_names,
        default=None,
        help=f"paths to measure (default all): {','.join(PATH_NAMES)}",
    )
    parser.add_argument(
        "--modes",
        type=_names,
        default=None,
        help="inference modes to sweep (default all three; --quick and the small model: "
        "predict): " + ",".join(MODES),
    )
    parser.add_argument(
        "--suites",
        type=_names,
        default=None,
        help=f"what to run (default throughput,overhead,latency): {','.join(SUITES)}",
    )
    parser.add_argument(
        "--levels", type=_ints, default=None, help="requests in flight, e.g. 1,8,64"
    )
    parser.add_argument("--tiles", type=_count, default=None, help="tiles per measurement")
    parser.add_argument("--rounds", type=_count, default=None, help="interleaved rounds")
    parser.add_argument(
        "--max-batch-size",
        type=_count,
        default=None,
        help="the largest batch on every path: the batchers' limit, and the chunk the explicit "
        "and raw paths send (default: 64)",
    )
    parser.add_argument(
        "--max-wait-ms",
        type=_milliseconds,
        default=None,
        help="the longest, in ms, a batcher holds a tile waiting for others (default: 5)",
    )
    parser.add_argument(
        "--seed", type=_seed, default=None, help="seed of the request bodies and the rounds' order"
    )
    parser.add_argument(
        "--dtype",
        choices=REFERENCE_DTYPES,
        default=None,
        help="precision of the reference checkpoints (default float32; histoinfer export --dtype)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where reference checkpoints and bodies are cached (default: user cache dir)",
    )
    parser.add_argument(
        "--shared-process",
        action="store_true",
        help="measure every path in this process instead of one process each: starts faster, "
        "but paths slow each other down (OpenMP; see docs/benchmarks-history.md)",
    )
    parser.add_argument("--quiet", action="store_true", help="print no progress lines")
    parser.set_defaults(_bench_parser=parser)


def _canonical_command(args: argparse.Namespace, prog: str = "histoinfer bench") -> str:
    """The command that reproduces ``args``: ``prog`` and every option not at its default."""
    parser: argparse.ArgumentParser | None = getattr(args, "_bench_parser", None)
    words = prog.split()
    for action in parser._actions if parser is not None else []:
        if not action.option_strings or action.dest in ("help", "quiet"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        option = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(option)
        elif isinstance(value, list):  # a repeated option (--import)
            words += [f"{option}={v}" for v in value]
        else:
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            words.append(f"{option}={shown}")
    return shlex.join(words)


def _refuse_combinations(args: argparse.Namespace) -> None:
    """Options that make no sense together (UsageError), before anything is loaded."""
    given = getattr(args, "checkpoint", None) is not None
    if not given:
        for option, value in (
            ("--model-key", args.model_key),
            ("--import", args.imports),
            ("--assets", args.assets),
        ):
            if value is not None:
                raise UsageError(f"{option} goes with --checkpoint (a model of your own)")
        return
    clashes = [
        ("--models", args.models is not None, "the reference sizes"),
        ("--small", args.small, "a reference size"),
        ("--dtype", args.dtype is not None, "precision belongs to the checkpoint"),
        ("--suites profile", "profile" in (args.suites or ()), "it profiles the tiny model"),
    ]
    for option, clash, why in clashes:
        if clash:
            raise UsageError(f"--checkpoint cannot go with {option} ({why})")


def config_from_args(args: argparse.Namespace) -> Any:
    from .own import OwnModel
    from .runner import BenchConfig, quick_config

    _refuse_combinations(args)
    cfg = quick_config() if args.quick else BenchConfig()
    changes: dict[str, Any] = {}
    if args.checkpoint is not None:
        own = OwnModel(
            str(args.checkpoint),
            args.model_key or "h1",
            tuple(args.imports or ()),
            None if args.assets is None else str(args.assets),
        )
        changes["own"] = own
        changes["models"] = (own.label,)
    elif args.models is not None:
        unknown_models = [m for m in args.models if m not in ("tiny", "small")]
        if unknown_models:
            raise ValueError(f"unknown model sizes: {', '.join(unknown_models)} (tiny, small)")
        changes["models"] = args.models
    elif args.small:
        changes["models"] = ("tiny", "small")
    names = ("paths", "levels", "tiles", "rounds", "max_batch_size", "max_wait_ms", "seed", "dtype")
    for name in names:
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.modes is not None:
        unknown = [m for m in args.modes if m not in MODES]
        if unknown or not args.modes:
            raise ValueError(
                f"unknown modes: {', '.join(unknown)} (choose from {', '.join(MODES)})"
            )
        changes["modes"] = changes["small_modes"] = args.modes
    if args.suites is not None:
        unknown = [s for s in args.suites if s not in SUITES]
        if unknown:
            raise ValueError(
                f"unknown suites: {', '.join(unknown)} (choose from {', '.join(SUITES)})"
            )
        changes["suites"] = args.suites
    if args.workdir is not None:
        changes["workdir"] = str(args.workdir)
    if args.shared_process:
        changes["isolate"] = False
    return replace(cfg, **changes)


def run(args: argparse.Namespace) -> int:
    """Run ``histoinfer bench``; print where the outputs are, and the targets' results."""
    # The plot's, imported now: missing, it failed the command after its minutes of measuring
    # (a trial); the command then names the extra that installs it.
    import matplotlib  # noqa: F401

    from .own import resolve_own
    from .report import write_outputs
    from .runner import run_bench, verdict

    prog = getattr(args, "_prog", "histoinfer bench")
    try:
        cfg = config_from_args(args)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    started = time.monotonic()

    def log(line: str) -> None:
        if not args.quiet:
            print(f"{time.monotonic() - started:6.1f}s {line}", file=sys.stderr, flush=True)

    # An own checkpoint, loaded once here: what is wrong with it is said before any child starts.
    cfg = resolve_own(cfg, args.modes is not None, log)
    command = _canonical_command(args, prog)
    report = run_bench(cfg, log, command)
    for path in write_outputs(report, args.out):
        print(f"wrote {path}")
    for failure in report.get("failed", []):
        print(f"  FAILED: the {failure['suite']} suite: {failure['error']}", file=sys.stderr)
    checks = [
        check
        for section in ("throughput", "overhead", "latency")
        for check in report.get(section, {}).get("checks", [])
    ]
    if checks:
        # The targets are the project's own (an evaluator read "#5" as a reference to a
        # document it did not have): said as such, with where they are explained.
        print("targets the project set itself (docs/benchmarks.md, 'Targets'):")
    for check in checks:
        value = "–" if check["value"] is None else f"{check['value']:.3f}"
        sign = ">=" if check["higher_is_better"] else "<="
        target = f"target {sign} {check['target']:g}"
        print(f"  {check['name']}: {value} ({target}) {verdict(check)}")
    for floor in report.get("throughput", {}).get("noise_floor", []):
        print(
            f"  noise floor ({floor['model']}, {floor.get('in_flight', floor['concurrency'])} "
            "in flight): identical "
            f"processes differed by up to {floor['spread']:.1%} a round"
        )
    # after the targets' lines and their noise floor, under a heading of its own
    _print_level_ratios(report.get("throughput", {}).get("level_ratios", []))
    print(f"done in {report['seconds']} s")
    return 1 if report.get("failed") else 0


def _print_level_ratios(ratios: Sequence[dict[str, Any]]) -> None:
    """Each ratio at every level, a line each, for each model's first mode (report.md has
    every mode's)."""
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    first_mode: dict[str, str] = {}
    for r in ratios:
        if first_mode.setdefault(r["model"], r["mode"]) == r["mode"]:
            lines.setdefault((r["model"], r["ratio"]), []).append(r)
    if lines:
        print("ratios at every level (report.md, 'Ratios at every level'):")
    for (model, name), found in lines.items():
        levels = " / ".join(str(r["in_flight"]) for r in found)
        values = " / ".join(f"{r['median']:.3f}" for r in found)
        print(f"  {name} ({model}, {first_mode[model]}) at {levels} in flight: {values}")


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = "histoinfer bench",
    defaults: Sequence[str] = (),
    description: str | None = None,
) -> int:
    """Run as a script (``benchmarks/*.py``): the options of ``histoinfer bench``.

    ``defaults`` are options the script puts before the user's own (which override them);
    ``--help`` shows them, after ``description`` (the script's docstring), as written.
    """
    import logging

    epilog = f"this script's own defaults, before yours: {' '.join(defaults)}" if defaults else None
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    if description is not None:  # the script's own words, not the command's
        parser.description = description
    user = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args([*defaults, *user])
    args._prog = prog
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (CommandError, InferenceError, OSError, ValueError) as exc:
        # What histoinfer's own main says in a line (an own checkpoint's refusals among them)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
