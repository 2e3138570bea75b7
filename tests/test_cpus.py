"""Work is sized to the CPUs the process may run on, not the machine's: under ``taskset``, a
SLURM job's cpuset or a container's, ``os.cpu_count()`` counts every core of the host."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from histoinfer.clients import inprocess
from histoinfer.cpus import usable_cpus
from histoinfer.models import ServerModel

pytestmark = pytest.mark.timeout(60)


def test_usable_cpus_is_the_process_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7}, raising=False)
    assert usable_cpus() == 3


def test_usable_cpus_without_affinity_is_the_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpus() == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert usable_cpus() == 12


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs util-linux's taskset")
def test_a_process_pinned_to_one_core_sees_one() -> None:
    code = "from histoinfer.cpus import usable_cpus; print(usable_cpus())"
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == "1"


def test_decode_threads_fit_the_cores_granted(
    tiny_model: ServerModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a SLURM job of 2 cores on a 64-core node decoded on 64 threads a loop,
    beside torch's 2 for the passes."""
    granted = max(2, torch.get_num_threads())
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(granted)), raising=False)
    assert 1 <= inprocess._default_prepare_threads(tiny_model) <= granted
