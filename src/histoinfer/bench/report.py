"""Writing a run out: ``report.json`` (everything), ``report.md`` (tables) and ``report.png``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .names import PATH_DESCRIPTIONS, PATH_NAMES
from .own import describe
from .runner import verdict

__all__ = ["markdown", "write_outputs"]


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _runners(runners: dict[str, str] | str | None) -> str:
    """How each model's program ran (models/scripted.py), for the report's opening lines;
    reports of session 10 hold one string for every model."""
    if not runners:
        return ""
    if isinstance(runners, str):
        return f" The program runs as: {runners}."
    if len(set(runners.values())) == 1:
        return f" The program runs as: {next(iter(runners.values()))}."
    return " The program runs as: " + "; ".join(f"{m}: {r}" for m, r in runners.items()) + "."


def _rounds(cfg: dict[str, Any], report: dict[str, Any]) -> str:
    """How many rounds ran: the small model runs at most ``small_rounds``."""
    rounds, small = cfg["rounds"], cfg.get("small_rounds", cfg["rounds"])
    rows = (report.get("throughput") or {}).get("rows") or []
    if min(rounds, small) == rounds or not any(r["model"] == "small" for r in rows):
        return str(rounds)
    return f"{rounds} (the small model's sweep: {min(rounds, small)})"


def _load(values: list[float] | None) -> str:
    return "–" if not values else "/".join(f"{v:.2f}" for v in values)


def _in_flight(row: dict[str, Any]) -> int:
    """Requests really in flight (reports written before it was recorded: as asked)."""
    return int(row.get("in_flight", row["concurrency"]))


def _is_burst(row: dict[str, Any]) -> bool:
    """Each caller sent one request: as many in flight as tiles measured."""
    return bool(row.get("in_flight", 0) == row["tiles"] > 1)


_BURST_NOTE = (
    "Where the requests in flight are as many as the tiles measured, each caller sends one "
    "request: a burst, all at once, not a steady state (its p50 is about half the burst's "
    "time). The explicit loop and the raw forward run chunks of at most max_batch_size; their "
    "latencies are what the same callers would see, waiting behind earlier chunks included."
)

_COLUMNS_NOTE = (
    "Each figure is its own median over the rounds, so one row's figures may come from "
    "different rounds (`report.json` holds every round's); a target is the median of its "
    "per-round ratios. Latency percentiles are nearest-rank: of fewer than 100 requests, p99 "
    "is the slowest one. *Forward busy* is the device thread's time in batches over wall "
    "time: at 1 in flight the dynamic paths decode a lone request there too, so it includes "
    "a decode; the raw forward's is its wall time by definition."
)


def _mode(row: dict[str, Any]) -> str:
    return str(row.get("mode", "predict"))  # reports written before --modes have none


_CPU_SPLIT_HEADER = "of which forward / main / other"
_CPU_SPLIT_NOTE = (
    "CPU ms/tile by thread: *forward* = the device's thread and its helpers, and torch's own "
    "OpenMP workers (the forward passes), *main* = the main thread (an async path's event "
    "loop, the explicit loop's caller; the HTTP client's loop), *other* = every other thread "
    "(decoding, sync callers; the external batchers' passes run on the device's thread, so "
    "they count as forward), then the HTTP path's server process. Medians over rounds, each "
    "on its own, so they need not add up."
)


def _cpu_split_cell(row: dict[str, Any]) -> str:
    split = row.get("cpu_ms_per_tile_by_role") or {}
    if not split:
        return "–"
    cell = " / ".join(_num(split.get(role), 2) for role in ("forward", "main", "other"))
    return cell + (f" + {split['server']:.2f} server" if "server" in split else "")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, as lines."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _checks_table(checks: list[dict[str, Any]]) -> list[str]:
    headers = ["target", "issue", "value (median)", "bound", "per round", "result", "conditions"]
    rows = []
    for c in checks:
        bound = ("≥ " if c["higher_is_better"] else "≤ ") + f"{c['target']:g}"
        rounds = ", ".join(f"{v:.2f}" for v in c["per_round"])
        # Bold only what the rounds decided, met or not: a median met by chance is no result.
        decided = c["met"] is not None and c.get("decided")
        head = "met" if c["met"] else "not met"
        result = verdict(c).replace(head, f"**{head}**", 1) if decided else verdict(c)
        issue = f"issue {c['issue']}" if c["issue"] else "–"
        rows.append([c["name"], issue, _num(c["value"], 3), bound, rounds, result, c["detail"]])
    return _table(headers, rows)


def _profile_section(profile: dict[str, Any]) -> list[str]:
    out = [
        "## Where a request's time goes (tiny model)",
        "",
        f"Body {profile['body_bytes']} bytes (PNG {profile['png_bytes']} bytes); torch uses "
        f"{profile['torch_threads']} threads. Cost: each step alone on one thread. GIL held: "
        "the share of the step's running time during which it holds the GIL (py-spy, the step "
        "alone in a loop); a step near 0% runs in parallel with others, near 100% excludes them.",
        "",
    ]
    rows = []
    for row in profile["steps"]:
        share = row.get("gil_share")
        cpu = _num(row.get("cpu_us_per_tile"), 0)
        rows.append(
            [row["step"], f"{row['us_per_tile']:.0f}", cpu, _pct(share and min(share, 1.0))]
        )
    out += _table(["step", "µs per tile", "CPU µs per tile", "GIL held"], rows)
    budget = profile.get("cpu_budget")
    if budget:
        out += [
            f"CPU budget: one request costs {budget['sequential_us_per_tile']:.0f} µs of wall "
            f"time done step after step (the explicit loop: "
            f"{budget['explicit_tiles_s']:.0f} tiles/s) and {budget['cpu_us_per_tile']:.0f} µs of "
            f"CPU. Spread perfectly over {budget['cores']} cores, and if sharing the cores "
            f"cost no extra CPU, that is at most {budget['pipelined_ceiling_tiles_s']:.0f} "
            f"tiles/s: **{budget['ceiling_ratio']:.2f}x** the explicit loop, an upper bound for "
            "any batcher on this machine (sharing does cost CPU: compare the paths' CPU ms per "
            "tile; under external load the forward pass's CPU is understated).",
            "",
        ]
    skipped = profile.get("gil_by_step", {}).get("skipped")
    if skipped:
        out += [f"GIL by step skipped: {skipped}", ""]
    sampling = profile.get("sampling", {})
    if "skipped" in sampling:
        out += [f"Sampling profile skipped: {sampling['skipped']}", ""]
    elif sampling:
        gil, cpu = sampling["gil"], sampling["cpu"]
        out += [
            f"py-spy, dynamic batching on asyncio with 512 in flight, {sampling['seconds']} s "
            f"at {sampling['rate_hz']} Hz: the GIL is held {_pct(gil['share_of_wall'])} of the "
            f"wall time; {cpu['share_of_wall']:.2f} Python threads are runnable on average "
            "(threads waiting for the GIL included, torch's own worker threads not).",
            "",
        ]
        steps = dict.fromkeys([*gil["steps"], *cpu["steps"]])
        rows = [[s, _pct(gil["steps"].get(s)), _pct(cpu["steps"].get(s))] for s in steps]
        out += _table(["step", "share of GIL-held samples", "share of runnable samples"], rows)
    return out


def _paths_legend(rows: Sequence[dict[str, Any]]) -> str:
    """What each path measured runs, in a line each (a reader of the report alone had only the
    http path's, a user trial found), naming the calls of the mode swept: an embed-only
    model's run said ``predict_async``. With several modes, ``MODE`` stands for the row's."""
    modes = list(dict.fromkeys(_mode(row) for row in rows))
    mode = modes[0] if len(modes) == 1 else "MODE"
    described = [
        f"`{path}`: {PATH_DESCRIPTIONS[path].format(mode=mode)}"
        for path in dict.fromkeys(row["path"] for row in rows)
        if path in PATH_DESCRIPTIONS
    ]
    said = "; ".join(described) + " (details: docs/benchmarks.md)."
    if len(modes) > 1:
        said += f" MODE is the row's mode: {', '.join(modes)}."
    return f"Paths: {said}"


def _level_ratios_section(ratios: Sequence[dict[str, Any]]) -> list[str]:
    """The paths' ratios at every level: a table for each model (its own levels: the small
    model's one level made every tiny row's column empty), a row for each mode and ratio
    (reports from before they were kept have none: no section)."""
    if not ratios:
        return []
    out = [
        "## Ratios at every level",
        "",
        "Each the median of its rounds' ratios, the two paths measured side by side in every "
        "round; the targets read the largest level (and the first mode) alone.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in ratios):
        mine = [r for r in ratios if r["model"] == model]
        levels = sorted({r["in_flight"] for r in mine})
        table: dict[tuple[str, str], dict[int, float]] = {}
        for r in mine:
            table.setdefault((r["mode"], r["ratio"]), {})[r["in_flight"]] = r["median"]
        rows = [
            [model, mode, name] + [_num(by_level.get(level), 3) for level in levels]
            for (mode, name), by_level in table.items()
        ]
        headers = ["model", "mode", "ratio (tiles/s over tiles/s)"]
        headers += [f"{level} in flight" for level in levels]
        out += _table(headers, rows)
    return out


def _cpus(env: dict[str, Any]) -> str:
    """The CPUs the bench ran on, and the machine's where the process had fewer."""
    cpus, machine = env["cpus"], env.get("machine_cpus")
    return f"{cpus} CPUs" + (
        f" (of the machine's {machine})" if machine not in (None, cpus) else ""
    )


def _libraries(env: dict[str, Any]) -> str:
    """The async libraries and the peer, as installed (reports from before session 25 have
    none: anyio's read null)."""
    named = [f"{name} {env[name]}" for name in ("anyio", "trio", "async-batcher") if env.get(name)]
    return "".join(f"{name}, " for name in named)


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: what ran, the tables, and the targets with their results."""
    env = report["environment"]
    cfg = report["config"]
    dtype = cfg.get("dtype", "float32")  # reports from before --dtype have none
    precision = "" if dtype == "float32" else f", checkpoints in {dtype}"
    out = [
        "# histoinfer bench",
        "",
        f"`{report['command']}` — {report['date']}, {report['seconds']} s",
        "",
        f"{_cpus(env)}, torch {env['torch']} ({env['torch_threads']} threads), "
        f"Python {env['python']}, {_libraries(env)}CUDA: {env['cuda']}, commit {env['commit']}, "
        f"load average {_load(env['load_average'])} → {_load(env.get('load_average_end'))}. "
        f"max_batch_size {cfg['max_batch_size']}, max_wait_ms {cfg['max_wait_ms']}"
        f"{precision}; "
        f"medians over {_rounds(cfg, report)} interleaved rounds."
        + (f" CPU forward passes: {env['cpu_passes']}." if env.get("cpu_passes") else "")
        + _runners(env.get("program_runner"))
        + (
            f" PNG decoders, first that takes a tile: {', '.join(env['png_decoders'])}."
            if env.get("png_decoders")
            else ""
        ),
        "",
        describe(cfg["own"])
        if cfg.get("own")
        else "The reference checkpoints have seeded, untrained weights: the real architecture, "
        "file format and costs, but outputs that mean nothing biologically.",
        "",
    ]
    for failure in report.get("failed", []):
        out += [f"**The {failure['suite']} suite failed**: {failure['error']}", ""]
    checks: list[dict[str, Any]] = []
    throughput = report.get("throughput")
    if throughput:
        headers = ["model", "path", "mode", "in flight", "tiles", "tiles/s", "p50 ms", "p95 ms"]
        headers += ["p99 ms", "mean batch", "forward busy", "CPU ms/tile", _CPU_SPLIT_HEADER]
        rows = [
            [row["model"], row["path"], _mode(row), str(_in_flight(row))]
            + [str(row["tiles"])]
            + [f"{row['throughput']:.1f}"]
            + [f"{row['latency_ms'][q]:.1f}" for q in ("p50", "p95", "p99")]
            + [_num(row["mean_batch_size"]), _pct(row["forward_busy"])]
            + [_num(row.get("cpu_ms_per_tile"), 2), _cpu_split_cell(row)]
            for row in throughput["rows"]
        ]
        out += ["## Throughput and latency", "", *_table(headers, rows)]
        out += [_paths_legend(throughput["rows"]), ""]
        out += [_COLUMNS_NOTE, ""]
        if any(_is_burst(row) for row in throughput["rows"]):
            out += [_BURST_NOTE, ""]
        if any(row.get("cpu_ms_per_tile_by_role") for row in throughput["rows"]):
            out += [_CPU_SPLIT_NOTE, ""]
        for skip in throughput["skipped"]:
            out.append(f"- skipped `{skip['path']}` ({skip['model']}): {skip['reason']}")
        for note in throughput.get("notes", []):
            out.append(f"- `{note['path']}` ({note['model']}): {note['note']}")
        if throughput["skipped"] or throughput.get("notes"):
            out.append("")
        checks += throughput["checks"]
    overhead = report.get("overhead")
    if overhead:
        headers = ["batcher", "in flight", "requests", "req/s", "p50 ms", "p95 ms", "p99 ms"]
        headers += ["mean batch"]
        rows = [
            [row["label"], str(row["concurrency"]), str(row["tiles"]), f"{row['throughput']:.0f}"]
            + [f"{row['latency_ms'][q]:.2f}" for q in ("p50", "p95", "p99")]
            + [_num(row["mean_batch_size"])]
            for row in overhead["rows"]
        ]
        out += ["## Scheduler overhead (no-op batch function)", "", *_table(headers, rows)]
        for skip in overhead.get("skipped", []):
            out += [f"- skipped `{skip['variant']}`: {skip['reason']}", ""]
        checks += overhead["checks"]
    latency = report.get("latency")
    if latency:
        rows = []
        for row in latency["rows"]:
            rounds = ", ".join(f"{v:.2f}" for v in row["p50_ms_rounds"])
            tails = [_num(row.get(q), 2) for q in ("p95_ms", "p99_ms")]  # older: p50 only
            rows.append([row["model"], row["variant"], f"{row['p50_ms']:.2f}", *tails, rounds])
        out += ["## Lone request latency (concurrency 1, max_wait_ms=5)", ""]
        headers = ["model", "variant", "p50 ms", "p95 ms", "p99 ms", "p50 per round"]
        out += _table(headers, rows)
        out += [
            "Medians over rounds of each round's percentiles; the targets read the p50.",
            "",
        ]
        checks += latency["checks"]
    if checks:
        out += [
            "## Targets",
            "",
            "Bounds the project set itself, in its issues 3 and 5 (docs/benchmarks.md, "
            "'Targets', says what each means and why some are out of reach on a small CPU)."
            + (
                " They are set for the reference models: an own checkpoint's ratios are "
                "reported beside them, not evaluated."
                if any(c.get("not_evaluated") for c in checks)
                else ""
            ),
            "",
            *_checks_table(checks),
        ]
    out += _level_ratios_section((throughput or {}).get("level_ratios") or [])
    floors = (throughput or {}).get("noise_floor") or []
    if floors:
        out += [
            "## Noise floor",
            "",
            "`dynamic-asyncio-twin` runs the same code as `dynamic-asyncio` in another process,"
            " in the same rounds: their ratio is what chance alone does to a ratio in this run.",
            "",
            *_table(
                ["model", "mode", "in flight", "twin / original (median)", "largest gap", "rounds"],
                [
                    [
                        f["model"],
                        f["mode"],
                        str(f.get("in_flight", f["concurrency"])),
                        f"{f['median']:.3f}",
                        f"{f['spread']:.1%}",
                        ", ".join(f"{r:.3f}" for r in f["per_round"]),
                    ]
                    for f in floors
                ],
            ),
        ]
    profile = report.get("profile")
    if profile:
        out += _profile_section(profile)
    return "\n".join(out)


#: the line style of a path's series: the limit dotted, the external peers dashed, ours solid
_LINESTYLES = {"raw": ":", "async-batcher": "--", "asyncio-queue": "--"}
#: a colour and a marker for each path, none repeated across the bench's twelve (cycles of ten
#: colours and six markers drew raw and async-batcher in one blue, two paths with one marker)
_COLOURS = (*(f"C{i}" for i in range(10)), "black", "goldenrod")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
#: a latency axis spanning less than this ratio is linear: on a log scale, one level's narrow
#: range was labelled "1.57x10^4 ... 1.62x10^4"
_LOG_SPAN = 10.0


def _series_style(index: int, path: str) -> dict[str, Any]:
    """One look per path, the same in every panel."""
    return {
        "color": _COLOURS[index % len(_COLOURS)],
        "marker": _MARKERS[index % len(_MARKERS)],
        "linestyle": _LINESTYLES.get(path, "-"),
    }


def _spread(series: Sequence[dict[str, Any]]) -> list[list[float]] | None:
    """How far below and above each point's median its rounds went (error bars: with a noise
    floor of 20-30% a round, lines crossing inside their bars are no ranking)."""
    rounds = [row.get("throughput_rounds") or [] for row in series]
    if not all(rounds) or max(map(len, rounds)) < 2:
        return None
    # clamped: the rounds are kept to 0.1 tiles/s, the median is not
    below = [max(0.0, row["throughput"] - min(r)) for row, r in zip(series, rounds, strict=True)]
    above = [max(0.0, max(r) - row["throughput"]) for row, r in zip(series, rounds, strict=True)]
    return [below, above]


def _run_said(report: dict[str, Any]) -> str:
    """The run, in the figure's title: plots of two runs looked alike."""
    env = report.get("environment") or {}
    commit = f", commit {env['commit']}" if env.get("commit") else ""
    cpus = f", {env['cpus']} CPUs" if env.get("cpus") else ""
    return f"histoinfer bench, {report.get('date', '')}{cpus}{commit}"


def figure(report: dict[str, Any]) -> Any:
    """Throughput (each point the median of its rounds, bars their range) and p95 latency
    against requests in flight: a row of two panels for each model and mode, and one legend of
    the paths beside them, outside every panel (a full run's 36 series in one legend covered
    its throughput panel). ``None``: nothing to plot."""
    throughput = report.get("throughput")
    if not throughput or not throughput["rows"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = throughput["rows"]
    paths = list(dict.fromkeys(row["path"] for row in rows))
    # by the path's place among the bench's paths, not this run's: a path looks the same in
    # every report.png (a run without the twin drew async-batcher in another colour)
    extra = [name for name in paths if name not in PATH_NAMES]
    styles = {
        name: _series_style(
            PATH_NAMES.index(name) if name in PATH_NAMES else len(PATH_NAMES) + extra.index(name),
            name,
        )
        for name in paths
    }
    panels = list(dict.fromkeys((row["model"], _mode(row)) for row in rows))
    several_modes = {model for model, _ in panels if sum(m == model for m, _ in panels) > 1}
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.6 * len(panels) + 0.4), squeeze=False)
    for (ax_tp, ax_lat), (model, mode) in zip(axes, panels, strict=True):
        mine = [row for row in rows if (row["model"], _mode(row)) == (model, mode)]
        burst = " (the largest: one burst of every tile)" if any(map(_is_burst, mine)) else ""
        for name in dict.fromkeys(row["path"] for row in mine):
            series = sorted((r for r in mine if r["path"] == name), key=_in_flight)
            xs = [_in_flight(r) for r in series]  # as measured, as the table says
            ys = [r["throughput"] for r in series]
            ax_tp.plot(xs, ys, label=name, **styles[name])
            spread = _spread(series)
            if spread is not None:
                colour = styles[name]["color"]
                ax_tp.errorbar(xs, ys, yerr=spread, fmt="none", ecolor=colour, alpha=0.35)
            ax_lat.plot(xs, [r["latency_ms"]["p95"] for r in series], **styles[name])
        # a reference size is h1's; an own checkpoint's label says what it is
        title = f"{'h1 ' if model in ('tiny', 'small') else ''}{model}"
        title += f", {mode}" if model in several_modes or mode != "predict" else ""
        levels = sorted({_in_flight(row) for row in mine})
        for ax, what, unit in ((ax_tp, "throughput", "tiles/s"), (ax_lat, "p95 latency", "ms")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(level) for level in levels])  # the levels, not 2^k
            ax.minorticks_off()
            ax.set_title(f"{title}: {what}")
            ax.set_xlabel("requests in flight" + burst)
            ax.set_ylabel(unit)
            ax.grid(True, which="both", alpha=0.3)
        # from 0 (a zoomed axis made a 3% gap look like a gulf), the top set here: autoscaled,
        # its margin was a share of the data's spread and cut the highest points off
        tops = [max([r["throughput"], *(r.get("throughput_rounds") or [])]) for r in mine]
        ax_tp.set_ylim(0, 1.08 * max(tops) if max(tops) > 0 else 1.0)
        p95 = [row["latency_ms"]["p95"] for row in mine if row["latency_ms"]["p95"] > 0]
        if p95 and max(p95) >= _LOG_SPAN * min(p95):
            ax_lat.set_yscale("log")
        else:
            ax_lat.set_ylim(0, 1.08 * max(p95) if p95 else 1.0)
    fig.suptitle(_run_said(report), fontsize="medium")
    fig.tight_layout(rect=(0.0, 0.0, 0.8, 0.98))  # the right fifth for the legend
    handles = [Line2D([], [], label=name, **styles[name]) for name in paths]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.8, 0.97), fontsize="small")
    return fig


def plot(report: dict[str, Any], path: Path) -> bool:
    """Write :func:`figure` to ``path``; ``False`` where there is nothing to plot."""
    fig = figure(report)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``report.json``, ``report.md`` and (with results to plot) ``report.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    written.append(json_path)
    md_path = out_dir / "report.md"
    md_path.write_text(markdown(report), encoding="utf-8")
    written.append(md_path)
    png_path = out_dir / "report.png"
    if plot(report, png_path):
        written.append(png_path)
    return written
