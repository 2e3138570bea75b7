"""``benchmarks/http_client_pools.py`` and ``benchmarks/server_loop.py`` run end to end.

They reach into HttpClient's and uvicorn's internals (the shard size, the shared TLS context,
uvicorn's HTTP protocol table) to compare layouts; a change there must break a test, not the
next person's measurement. Tiny settings: the figures themselves are not checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: Both read the server's CPU from /proc, and refuse to run without it (Windows, macOS).
pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").is_file(), reason="the scripts read the server's CPU from /proc"
)


def _run(script: str, workdir: Path, *options: str) -> str:
    command = [sys.executable, str(BENCHMARKS / script), "--rounds", "1", "--bodies", "8"]
    command += ["--in-flight", "4", "--workdir", str(workdir), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def workdir(tiny_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(tiny_dir, tmp_path / "h1-tiny")
    return tmp_path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("calls", ["async", "sync"])
def test_http_client_pools_measures_every_layout(workdir: Path, calls: str) -> None:
    out = _run("http_client_pools.py", workdir, "--shards", "8,4", "--calls", calls)
    layouts = re.findall(
        r"^  shards of +(\d+), (one TLS context|TLS per client) *: +([\d.]+)", out, re.M
    )
    assert [(n, tls) for n, tls, _ in layouts] == [
        ("8", "TLS per client"),
        ("8", "one TLS context"),
        ("4", "TLS per client"),
        ("4", "one TLS context"),
    ], out
    assert all(float(tiles_s) > 0 for _, _, tiles_s in layouts)


@pytest.mark.timeout(240)
def test_server_loop_compares_two_versions(workdir: Path) -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = _run("server_loop.py", workdir, "--src", f"{src},{src}")
    assert re.findall(r"^ +([AB]): +[\d.]+ tiles/s", out, re.M) == ["A", "B"], out


@pytest.mark.timeout(240)
def test_server_loop_measures_both_parsers(workdir: Path) -> None:
    # A thread's CPU is read in clock ticks (10 ms): 8 requests of ~0.6 ms each read 0 on a
    # fast host (session 29's), so the loop's CPU may be 0 here; its throughput may not.
    out = _run("server_loop.py", workdir, "--bodies", "32")
    parsers = re.findall(
        r"^ +(h11|httptools): +([\d.]+) tiles/s, the server's event loop ([\d.]+) ms", out, re.M
    )
    assert [name for name, _, _ in parsers] == ["h11", "httptools"], out
    assert all(float(t) > 0 and float(ms) >= 0 for _, t, ms in parsers)
