"""The HTTP loopback path's server: ``histoinfer serve`` as a subprocess on a free local port.

The microservice and ``HttpClient`` may not exist yet in a given checkout: :func:`http_unavailable`
says why the path must be skipped, and the harness reports that instead of failing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["ServerProcess", "http_unavailable", "parse_metrics"]


def http_unavailable() -> str | None:
    """Why the HTTP loopback path cannot run here, or ``None`` if it can."""
    try:
        server = importlib.import_module("histoinfer.server")
    except ImportError as exc:
        return f"the microservice is not importable ({exc})"
    if not hasattr(server, "create_app"):
        return "histoinfer.server.create_app does not exist yet (the microservice is not built)"
    try:
        importlib.import_module("histoinfer.server.cli")
    except ImportError as exc:
        return f"'histoinfer serve' is not available ({exc})"
    try:
        importlib.import_module("httpx")
    except ImportError:
        return "httpx is not installed (pip install 'histoinfer[bench]')"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """``histoinfer serve`` for one checkpoint on ``127.0.0.1:<free port>``, until closed."""

    def __init__(
        self,
        checkpoint: Path,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        model: str = "h1",
        ready_timeout: float = 90.0,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model = model
        command = [
            sys.executable,
            "-m",
            "histoinfer",
            "serve",
            "--model",
            model,
            "--checkpoint",
            str(checkpoint),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-batch-size",
            str(max_batch_size),
            "--max-wait-ms",
            str(max_wait_ms),
        ]
        self.command = command
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the server
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"'histoinfer serve' exited with code {self._process.returncode}: "
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health/ready", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"'histoinfer serve' not ready after {timeout:.0f} s: {self.log_tail()}")

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system), from /proc; 0 if unknown."""
        try:
            fields = Path(f"/proc/{self._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, chars: int = 600) -> str:
        self._log.seek(0)
        text = self._log.read()
        return text[-chars:].strip().replace("\n", " | ")

    def metrics(self) -> dict[str, float]:
        import httpx

        try:
            response = httpx.get(f"{self.base_url}/metrics", timeout=5.0)
        except httpx.HTTPError:
            return {}
        return parse_metrics(response.text) if response.status_code == 200 else {}

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._log.close()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> the counters the harness uses: batches, samples, forward seconds.

    Best effort, by name: a histogram or summary whose name mentions ``batch_size`` gives
    batches (``_count``) and samples (``_sum``); a ``forward_busy`` counter (or else a
    ``forward`` histogram's ``_sum``) gives the forward seconds. Sums over labels (modes).
    Missing ones are simply absent.
    """
    found: dict[str, float] = {}
    forward_sum = 0.0
    has_forward_sum = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, value = match.group(1), float(match.group(3))
        key = None
        if "batch_size" in name and name.endswith("_count"):
            key = "batches"
        elif "batch_size" in name and name.endswith("_sum"):
            key = "samples"
        elif "forward_busy" in name and not name.endswith("_created"):
            key = "forward_s"
        elif "forward" in name and name.endswith("_sum"):
            forward_sum += value
            has_forward_sum = True
        if key is not None:
            found[key] = found.get(key, 0.0) + value
    if "forward_s" not in found and has_forward_sum:
        found["forward_s"] = forward_sum
    return found
