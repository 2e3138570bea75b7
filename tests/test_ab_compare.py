"""``benchmarks/ab_compare.py``: two versions side by side, in worker processes of their own."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ab_compare.py"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.timeout(180)
def test_ab_compare_measures_both_versions_and_prints_the_ratios(
    tiny_dir: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    shutil.copytree(tiny_dir, workdir / "h1-tiny")
    command = [sys.executable, str(SCRIPT), "--a", str(SRC), "--b", str(SRC), "--rounds", "1"]
    command += ["--bodies", "16", "--lone-calls", "3", "--workdir", str(workdir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    table = {
        match.group(1): (float(match.group(2)), float(match.group(3)), float(match.group(4)))
        for match in re.finditer(
            r"^\| (\w+) \([^)]*\) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", done.stdout, re.M
        )
    }
    assert set(table) == {"dynamic", "explicit", "lone"}, done.stdout
    for what, (a, b, ratio) in table.items():
        assert a > 0 and b > 0, what
        # B / A of the unrounded values, printed to 3 places; A and B are printed to 2, so
        # recomputing it from them is off by up to the rounding of each (lone: ~3 ms, ~0.3%).
        rounding = (b / a) * (0.005 / a + 0.005 / b) + 0.0005
        assert ratio == pytest.approx(b / a, abs=rounding), what
    assert "round 1/1 done" in done.stderr


def test_ab_compare_refuses_an_unknown_measure(tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--a", "x", "--b", "y", "--measure", "dynamic,speed"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown measure(s): speed" in done.stderr
