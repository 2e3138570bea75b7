"""The HTTP loopback path's server: ``histoinfer serve`` as a subprocess on a free local port.

The test suite starts its servers with the same :class:`ServerProcess` (and :func:`wait_ready`).

The microservice and ``HttpClient`` may not exist yet in a given checkout: :func:`http_unavailable`
says why the path must be skipped, and the harness reports that instead of failing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..extras import install_hint
from .own import REFERENCE_BUILD, ModelBuild

__all__ = ["ServerProcess", "free_port", "http_unavailable", "parse_metrics", "wait_ready"]


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
        return f"httpx is not installed (the 'bench' extra: {install_hint('bench')})"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(base_url: str, timeout: float, alive: Callable[[], bool] | None = None) -> None:
    """Poll ``/health/ready`` until it answers 200; raise with the last answer at the deadline.

    ``alive`` (if given) says whether the server is still running: once it is not, stop waiting.
    """
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError("the server exited before it was ready")
        try:
            response = httpx.get(f"{base_url}/health/ready", timeout=2.0)
        except httpx.TransportError as exc:
            last = repr(exc)
        else:
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text}"
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not ready after {timeout:g} s: {last}")


class ServerProcess:
    """``histoinfer serve ARGS --host 127.0.0.1 --port <free port>`` in a subprocess, until closed.

    Started and waited for (``/health/ready``) on construction; the output (stdout and stderr)
    goes to a temporary file, read with :meth:`output`. ``launcher`` replaces ``-m histoinfer``
    (e.g. a script that registers more models first); ``env`` is added to this process's
    environment. :meth:`close` (or leaving the ``with`` block) sends SIGTERM, then kills.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        launcher: Sequence[str] = ("-m", "histoinfer"),
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 90.0,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, *launcher, "serve", *args]
        self.command += ["--host", "127.0.0.1", "--port", str(self.port)]
        # Read by name, never through this handle: the child shares its file offset. Removed
        # by close(), not on closing: Windows cannot open by name a file that deletes itself.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="histoinfer-serve-", suffix=".log", delete=False
        )
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**_without_serve_settings(os.environ), "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        except BaseException:
            self._remove_log()
            raise
        try:
            wait_ready(self.base_url, ready_timeout, alive=lambda: self.proc.poll() is None)
        except BaseException as exc:
            self._stop()
            output = self.output()  # read before close() removes it (it said nothing before)
            self.close()
            raise RuntimeError(
                f"'histoinfer serve' did not start ({exc}); its output:\n{output}"
            ) from None

    @classmethod
    def for_checkpoint(
        cls,
        checkpoint: Path,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        build: ModelBuild = REFERENCE_BUILD,
    ) -> ServerProcess:
        """One model from one checkpoint, with the batching settings under test, built as
        ``build`` says (a model of the user's own: its key, ``--import``, ``--assets``)."""
        args = ["--model", build.key, "--checkpoint", str(checkpoint)]
        args += [word for name in build.imports for word in ("--import", name)]
        args += ["--assets", build.assets] if build.assets is not None else []
        args += ["--max-batch-size", str(max_batch_size), "--max-wait-ms", str(max_wait_ms)]
        return cls(args)

    def output(self) -> str:
        """Everything the server has written so far (stdout and stderr)."""
        try:
            return Path(self._log.name).read_text(encoding="utf-8", errors="replace")
        except OSError:  # closed: the file is gone
            return ""

    def log_tail(self, chars: int = 600) -> str:
        return self.output()[-chars:].strip().replace("\n", " | ")

    def cpu_s(self) -> float | None:
        """CPU seconds the server process has used (user + system), from /proc; ``None`` where
        that cannot be read (no /proc: Windows, macOS)."""
        return _proc_cpu_s(f"/proc/{self.proc.pid}/stat")

    def main_thread_cpu_s(self) -> float | None:
        """The same for the server's main thread alone (its event loop)."""
        return _proc_cpu_s(f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat")

    def metrics(self) -> dict[str, float]:
        import httpx

        try:
            response = httpx.get(f"{self.base_url}/metrics", timeout=5.0)
        except httpx.HTTPError:
            return {}
        return parse_metrics(response.text) if response.status_code == 200 else {}

    def terminate(self) -> None:
        """Send SIGTERM (the server drains) and return at once."""
        self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """SIGTERM, up to 15 s to exit, then SIGKILL; remove the output file."""
        self._stop()
        self._remove_log()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def _remove_log(self) -> None:
        self._log.close()
        # Windows refuses while another process holds the file open: left to the temp folder.
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def _proc_cpu_s(stat: str) -> float | None:
    """User + system CPU seconds from a /proc ``stat`` file; ``None`` if unknown (not Linux,
    gone): a 0 would read as a server that cost nothing."""
    try:
        fields = Path(stat).read_text(encoding="utf-8").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def _without_serve_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """This process's environment less ``serve``'s settings (``HISTOINFER_MAX_QUEUE``...): a
    container configured through them skewed or failed the bench's own server (a trial). The
    script cache's variable is not a setting of the server, and stays."""
    from ..models.script_cache import CACHE_ENV
    from ..server.environment import PREFIX

    return {
        name: value
        for name, value in environ.items()
        if not name.startswith(PREFIX) or name == CACHE_ENV
    }
