"""What a bench run's report says, from measurements made up here (no model runs): the paths'
ratios at every level, the paths' legend in the mode swept, and a plot a reader can read."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from histoinfer.bench.cli import _print_level_ratios
from histoinfer.bench.measure import Sample
from histoinfer.bench.names import PATH_NAMES
from histoinfer.bench.report import figure, markdown
from histoinfer.bench.runner import BenchConfig, Samples, level_ratios, summarize

LEVELS = (1, 8, 64, 512)


def _sample(tiles_per_s: float, tiles: int = 128) -> Sample:
    return Sample(tiles=tiles, wall_s=tiles / tiles_per_s, latencies_s=[0.01, 0.02, 0.03])


def _report(samples: Samples, cfg: BenchConfig) -> dict[str, Any]:
    """A report as ``run_bench`` writes it, around ``samples``."""
    rows = [
        {
            "model": model,
            "path": path,
            "mode": mode,
            "concurrency": level,
            "in_flight": level,
            **summarize(measured),
        }
        for (model, path, mode, level), measured in samples.items()
    ]
    environment = {
        "cpus": 2,
        "torch": "x",
        "torch_threads": 2,
        "python": "3.11",
        "cuda": False,
        "commit": None,
        "load_average": None,
    }
    return {
        "command": "test",
        "date": "today",
        "seconds": 1.0,
        "environment": environment,
        "config": {"rounds": 3, "max_batch_size": 64, "max_wait_ms": 5.0},
        "throughput": {
            "rows": rows,
            "skipped": [],
            "notes": [],
            "checks": [],
            "noise_floor": [],
            "level_ratios": level_ratios(samples, cfg),
        },
    }


def test_ratios_are_read_round_by_round_at_every_level_and_mode() -> None:
    cfg = BenchConfig(levels=(8, 512), modes=("predict", "embed"))
    samples: Samples = {}
    for mode, level in itertools.product(("predict", "embed"), (8, 512)):
        explicit = [400.0, 500.0, 400.0]
        # dynamic gains more at 512 than at 8, and more on embed: each cell its own
        gain = (1.1 if level == 8 else 1.3) + (0.1 if mode == "embed" else 0.0)
        dynamic = [v * gain for v in explicit]
        dynamic[1] *= 2  # one round's ratio twice the others': the median is not moved
        samples[("tiny", "explicit", mode, level)] = [_sample(v) for v in explicit]
        samples[("tiny", "dynamic-asyncio", mode, level)] = [_sample(v) for v in dynamic]
    samples[("tiny", "dynamic-trio", "predict", 8)] = [_sample(v) for v in (440, 1100, 440)]
    found = {(r["mode"], r["in_flight"], r["ratio"]): r for r in level_ratios(samples, cfg)}
    # trio / asyncio at 8 (predict), and dynamic / explicit everywhere; no other pair measured
    assert set(found) == {
        *((m, lv, "dynamic / explicit loop") for m in ("predict", "embed") for lv in (8, 512)),
        ("predict", 8, "trio / asyncio (dynamic)"),
    }
    assert found[("predict", 8, "dynamic / explicit loop")]["median"] == pytest.approx(1.1)
    assert found[("predict", 512, "dynamic / explicit loop")]["median"] == pytest.approx(1.3)
    assert found[("embed", 512, "dynamic / explicit loop")]["median"] == pytest.approx(1.4)
    assert found[("embed", 512, "dynamic / explicit loop")]["per_round"] == pytest.approx(
        [1.4, 2.8, 1.4]
    )
    assert found[("predict", 8, "trio / asyncio (dynamic)")]["median"] == pytest.approx(1.0)
    assert level_ratios({}, cfg) == []


def test_the_report_tabulates_every_ratio_at_every_level(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = BenchConfig(
        models=("tiny", "small"), levels=LEVELS, modes=("predict", "embed"), small_levels=(256,)
    )
    samples: Samples = {}
    for mode, level in itertools.product(("predict", "embed"), LEVELS):
        samples[("tiny", "explicit", mode, level)] = [_sample(400.0)] * 3
        samples[("tiny", "dynamic-asyncio", mode, level)] = [_sample(4.0 * level + 400)] * 3
        samples[("tiny", "http", mode, level)] = [_sample(200.0)] * 3
    # the small model at a level of its own: a table of its own (in one, every tiny row had
    # an empty column for it)
    samples[("small", "explicit", "predict", 256)] = [_sample(15.0)] * 3
    samples[("small", "dynamic-asyncio", "predict", 256)] = [_sample(16.5)] * 3
    md = markdown(_report(samples, cfg))
    section = md.split("## Ratios at every level", 1)[1]
    assert (
        "| model | mode | ratio (tiles/s over tiles/s) | 256 in flight |\n"
        "|---|---|---|---|\n"
        "| small | predict | dynamic / explicit loop | 1.100 |\n"
    ) in section
    assert "–" not in section  # every cell measured
    assert "| model | mode | ratio (tiles/s over tiles/s) | 1 in flight | 8 in flight |" in section
    assert "| tiny | predict | dynamic / explicit loop | 1.010 | 1.080 | 1.640 | 6.120 |" in section
    assert "| tiny | embed | in-process / HTTP loopback | 2.020 | 2.160 | 3.280 | 12.240 |" in (
        section
    )
    assert "async-batcher |" not in section  # not measured: no row

    _print_level_ratios(_report(samples, cfg)["throughput"]["level_ratios"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("ratios at every level")
    # the first mode's, in a line each; report.md has the others
    assert printed[1:] == [
        "  dynamic / explicit loop (tiny, predict) at 1 / 8 / 64 / 512 in flight: "
        "1.010 / 1.080 / 1.640 / 6.120",
        "  in-process / HTTP loopback (tiny, predict) at 1 / 8 / 64 / 512 in flight: "
        "2.020 / 2.160 / 3.280 / 12.240",
        "  dynamic / explicit loop (small, predict) at 256 in flight: 1.100",
    ]


def test_a_report_without_level_ratios_has_no_such_section() -> None:
    cfg = BenchConfig(levels=(8,), modes=("predict",))
    report = _report({("tiny", "raw", "predict", 8): [_sample(800.0)]}, cfg)
    assert report["throughput"]["level_ratios"] == []
    del report["throughput"]["level_ratios"]  # as reports written before they were kept
    assert "Ratios at every level" not in markdown(report)


def test_the_paths_legend_names_the_calls_of_the_mode_swept() -> None:
    """An embed-only model's run said ``predict_async`` (a user trial of --checkpoint)."""

    def legend(modes: tuple[str, ...]) -> str:
        cfg = BenchConfig(levels=(8,), modes=modes)  # type: ignore[arg-type]
        samples: Samples = {
            ("own:mine", path, mode, 8): [_sample(100.0)]
            for path, mode in itertools.product(("explicit", "dynamic-asyncio", "http"), modes)
        }
        md = markdown(_report(samples, cfg))
        return next(line for line in md.splitlines() if line.startswith("Paths: "))

    embed = legend(("embed",))
    assert "`explicit`: InProcessClient(dynamic_batching=False).embed_batch over" in embed
    assert "`dynamic-asyncio`: concurrent embed_async calls" in embed
    assert "HttpClient.embed_async" in embed
    assert "predict" not in embed and "MODE" not in embed
    several = legend(("predict", "embed"))
    assert "concurrent MODE_async calls" in several and "predict_async" not in several
    assert several.endswith("MODE is the row's mode: predict, embed.")


def test_the_plot_has_a_row_for_each_mode_and_its_legend_beside_the_panels() -> None:
    """A full run's legend (36 series) covered its throughput panel, and a colour cycle of ten
    drew two of the twelve paths alike."""
    modes = ("predict", "embed", "predict_with_embedding")
    cfg = BenchConfig(levels=LEVELS, modes=modes)
    samples: Samples = {
        # latency (3 tiles: 10, 20, 30 ms each) grows with the level: a wide range, log
        ("tiny", path, mode, level): [
            Sample(tiles=3, wall_s=3 / (100.0 + 10 * i + level), latencies_s=[s * level] * 3)
            for s in (0.01, 0.012)  # two rounds: their range is drawn
        ]
        for (i, path), mode, level in itertools.product(enumerate(PATH_NAMES), modes, LEVELS)
    }
    samples[("small", "raw", "predict", 256)] = [_sample(27.0)]
    samples[("small", "explicit", "predict", 256)] = [_sample(26.0)]
    report = _report(samples, cfg)
    report["date"], report["environment"]["commit"] = "2026-12-07 15:07:49", "c78fbeb"
    fig = figure(report)
    try:
        assert fig.get_suptitle() == "histoinfer bench, 2026-12-07 15:07:49, 2 CPUs, commit c78fbeb"
        panels = [ax for ax in fig.axes]
        assert len(panels) == 2 * (len(modes) + 1)  # tiny's three modes, small's one
        titles = [ax.get_title() for ax in panels]
        assert titles[:2] == ["h1 tiny, predict: throughput", "h1 tiny, predict: p95 latency"]
        assert titles[-2:] == ["h1 small: throughput", "h1 small: p95 latency"]
        # the measured levels on the axis, as numbers
        assert [t.get_text() for t in panels[0].get_xticklabels()] == ["1", "8", "64", "512"]
        [legend] = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == list(PATH_NAMES)
        looks = [
            (line.get_color(), line.get_marker(), line.get_linestyle())
            for line in legend.get_lines()
        ]
        # no colour and no marker drawn for two paths
        assert len({colour for colour, _, _ in looks}) == len(PATH_NAMES)
        assert len({marker for _, marker, _ in looks}) == len(PATH_NAMES)
        # every series of a path drawn as its legend entry, in every panel
        look_of = dict(zip(PATH_NAMES, looks, strict=True))
        for line in panels[0].get_lines():
            assert (line.get_color(), line.get_marker(), line.get_linestyle()) == look_of[
                line.get_label()
            ]
        # throughput from 0 (a zoomed axis made a 3% gap look like a gulf), each point's rounds
        # drawn as a bar; latency on a log scale where it spans 10x, else linear from 0
        for ax in panels[0::2]:
            assert ax.get_ylim()[0] == 0
        assert panels[0].collections, "no error bars"
        assert not panels[-2].collections  # one round each: no range to draw
        assert panels[1].get_yscale() == "log"
        assert panels[-1].get_yscale() == "linear" and panels[-1].get_ylim()[0] == 0
        # every point inside its panel (an autoscaled top cut the highest off)
        for ax in panels:
            top = ax.get_ylim()[1]
            assert all(max(line.get_ydata()) < top for line in ax.get_lines()), ax.get_title()
        renderer = fig.canvas.get_renderer()
        box = legend.get_window_extent(renderer)
        for ax in panels:
            assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        assert box.x1 <= fig.bbox.x1 and box.y0 >= fig.bbox.y0  # and inside the figure
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert figure({"throughput": {"rows": []}}) is None


def test_a_path_looks_the_same_in_every_run_and_a_lone_mode_is_named() -> None:
    """Styles were given by a path's place in the run's rows: a run without the twin drew
    async-batcher in another colour. A run of one mode other than predict never said which."""

    def looks(paths: tuple[str, ...], mode: str = "predict") -> dict[str, tuple[Any, ...]]:
        cfg = BenchConfig(levels=(8,), modes=(mode,))  # type: ignore[arg-type]
        samples: Samples = {("tiny", p, mode, 8): [_sample(100.0)] for p in paths}
        fig = figure(_report(samples, cfg))
        try:
            [legend] = fig.legends
            found = {
                text.get_text(): (line.get_color(), line.get_marker(), line.get_linestyle())
                for text, line in zip(legend.get_texts(), legend.get_lines(), strict=True)
            }
            found["title"] = (fig.axes[0].get_title(),)
            return found
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)

    every = looks(PATH_NAMES)
    some = looks(("raw", "async-batcher", "my-path"))
    assert some["async-batcher"] == every["async-batcher"]
    assert some["my-path"] not in [every[p] for p in PATH_NAMES]  # a path of a script's own
    assert every["title"] == ("h1 tiny: throughput",)
    assert looks(("explicit",), "embed")["title"] == ("h1 tiny, embed: throughput",)


def test_every_report_kept_in_the_repository_renders() -> None:
    """The kept runs' reports, of every version's shape (session 10's held its program runner
    as one string, and failed to render)."""
    from pathlib import Path

    import matplotlib.pyplot as plt

    kept = sorted((Path(__file__).parents[1] / "benchmarks" / "results").glob("*/report.json"))
    assert len(kept) > 50
    for path in kept:
        report = json.loads(path.read_text(encoding="utf-8"))
        assert markdown(report).startswith("# histoinfer bench"), path
        fig = figure(report)
        if fig is not None:
            plt.close(fig)
