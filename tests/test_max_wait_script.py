"""``benchmarks/max_wait.py`` runs end to end and reports every window it was asked for.

Tiny settings: the figures themselves are not checked (performance is never asserted in
tests), only that each row is measured, answered correctly (the script checks every response)
and set against the explicit loop measured in the same round.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "max_wait.py"


@pytest.mark.timeout(240)
def test_every_window_and_caller_kind_is_measured(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_dir, tmp_path / "h1-tiny")
    command = [sys.executable, str(SCRIPT), "--rounds", "1", "--bodies", "12", "--workdir"]
    command += [str(tmp_path), "--in-flight", "3", "--waits", "0,5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(
        r"^\| (async|threads) \| 3 \| ([^|]+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| "
        r"([\d.]+) \|$",
        done.stdout,
        re.M,
    )
    assert [(calls, wait.strip()) for calls, wait, *_ in rows] == [
        (calls, wait)
        for calls in ("async", "threads")
        for wait in ("0", "5", "explicit, chunks of N")
    ], done.stdout
    for _, wait, tiles_s, ratio, batch in rows:
        assert float(tiles_s) > 0 and 1 <= float(batch) <= 3
        if wait.startswith("explicit"):
            assert float(ratio) == 1.0  # the reference row is set against itself


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("option", "value"), [("--calls", "processes"), ("--waits", "5,soon"), ("--waits", "-1")]
)
def test_bad_options_are_named(option: str, value: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), option, value],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2 and option in done.stderr, done.stderr
