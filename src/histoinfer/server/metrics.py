"""``GET /metrics``: Prometheus text read from ``client.stats()`` at scrape time.

The schedulers already keep thread-safe statistics (batch-size histogram, queue wait and forward
percentiles, errors, live queue depth); a custom collector reads them when Prometheus scrapes,
so the request path does no extra bookkeeping for metrics beyond the HTTP counters: a pure ASGI
middleware counts every response by route, model, mode and status, and observes its duration in
a histogram, with a few µs of the event loop's CPU a request. Each app has its own registry:
two apps in one process (tests, several models) never collide in a global one; the process's
own metrics (``process_*``, ``python_*``) are read into it too.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..batching import DURATION_BOUNDS
from ..schema import MODES

if TYPE_CHECKING:
    from ..clients.inprocess import InProcessClient

__all__ = [
    "DURATION_BUCKETS",
    "OTHER_ROUTE",
    "UNKNOWN",
    "HttpCounters",
    "StatsCollector",
    "render_metrics",
]

_F = TypeVar("_F", bound=Metric)
_QUANTILES = (("p50", "0.5"), ("p95", "0.95"), ("p99", "0.99"))

#: Upper bounds (seconds) of ``histoinfer_http_request_duration_seconds``: 1 ms to 60 s.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)  # fmt: skip
_LE = (*(str(b) for b in DURATION_BUCKETS), "+Inf")  # as Go formats them: "0.001", "1.0"

#: The ``route`` label: the app's route templates, never a raw path (a scanner's random paths
#: would make a new series each); every path that is none of them is ``OTHER_ROUTE``.
SINGLE_ROUTE = "/api/{mode}/{model}"
BATCH_ROUTE = "/api/{mode}/{model}/batch"
METADATA_ROUTE = "/api/metadata/{model}"
STATS_ROUTE = "/api/stats/{model}"
INVOCATIONS_ROUTE = "/invocations"
_FIXED_ROUTES = (
    INVOCATIONS_ROUTE, "/api/models", "/health/live", "/health/ready", "/ping", "/metrics",
)  # fmt: skip
OTHER_ROUTE = "other"
#: The ``model`` (``mode``) label of a path naming a model (mode) not served here.
UNKNOWN = "unknown"
#: Where requests are in flight or were answered: (route, model, mode); "" where the path names
#: no model or mode (``/invocations`` names them in its body, which is not parsed for this).
_Key = tuple[str, str, str]
_LABELS = ["route", "model", "mode"]


class _Series:
    """One (route, model, mode)'s requests in flight, responses by status, and durations."""

    __slots__ = ("buckets", "in_flight", "key", "statuses", "total")

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.in_flight = 0
        self.statuses: dict[int, int] = {}
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)  # per bucket, not cumulative; +Inf last
        self.total = 0.0  # seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for le, n in zip(_LE, self.buckets, strict=True):
            running += n
            out.append((le, float(running)))
        return out


class HttpCounters:
    """Every HTTP request in flight, responded to (by status) and timed, by (route, model,
    mode), kept by a pure ASGI middleware.

    Updated only on the server's event loop, so plain ints need no lock. The labels of a path
    are one dict lookup for every path the app answers (the table is built from the served
    models), a split of the path for the rest; there are at most ``routes × (models + 2) ×
    (modes + 2)`` series, whatever paths clients send.
    """

    def __init__(self, models: Iterable[str] | None = None) -> None:
        #: The served models' names, or None until :meth:`serve` names them (every model
        #: label is then ``unknown``).
        self.models: frozenset[str] | None = None
        self._series: dict[_Key, _Series] = {}
        #: Bytes of request bodies held now, over every request (the app counts them).
        self.bodies_held = 0
        self._by_path: dict[str, _Series] = {}  # the exact paths of the served routes
        if models is not None:
            self.serve(models)

    def serve(self, models: Iterable[str]) -> None:
        """Name the models served, whose names become ``model`` label values."""
        self.models = frozenset(models)
        table = {route: ("", "") for route in _FIXED_ROUTES}
        for model in self.models:
            table[f"/api/metadata/{model}"] = (model, "")
            table[f"/api/stats/{model}"] = (model, "")
            for mode in MODES:
                table[f"/api/{mode}/{model}"] = (model, mode)
                table[f"/api/{mode}/{model}/batch"] = (model, mode)
        self._by_path.clear()  # in place: the middleware holds this dict
        for path in table:
            self._by_path[path] = self._labelled(path)

    @property
    def in_flight(self) -> int:
        """Requests in flight now, on every route."""
        return sum(s.in_flight for s in list(self._series.values()))

    @property
    def responses(self) -> Counter[int]:
        """Responses sent by status, on every route."""
        out: Counter[int] = Counter()
        for series in list(self._series.values()):
            out.update(series.statuses)
        return out

    def series(self) -> list[_Series]:
        """The series with a request so far, sorted by label values."""
        return sorted(
            (s for s in list(self._series.values()) if s.in_flight or s.statuses),
            key=lambda s: s.key,
        )

    def _labelled(self, path: str) -> _Series:
        """The series of a path not in the table of served paths (or while building it)."""
        key = self._labels(path)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(key)
        return series

    def _labels(self, path: str) -> _Key:
        if path in _FIXED_ROUTES:
            return (path, "", "")
        parts = path.split("/")  # "/api/predict/h1/batch": ["", "api", "predict", "h1", "batch"]
        n = len(parts)
        if not (n == 4 or (n == 5 and parts[4] == "batch")) or parts[:2] != ["", "api"]:
            return (OTHER_ROUTE, "", "")
        first, model = parts[2], parts[3]
        if not first or not model:
            return (OTHER_ROUTE, "", "")
        model = model if self.models is not None and model in self.models else UNKNOWN
        if n == 4 and first in ("metadata", "stats"):
            return (METADATA_ROUTE if first == "metadata" else STATS_ROUTE, model, "")
        mode = first if first in MODES else UNKNOWN
        return (SINGLE_ROUTE if n == 4 else BATCH_ROUTE, model, mode)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        by_path, labelled = self._by_path, self._labelled
        clock, bounds = time.perf_counter, DURATION_BUCKETS

        async def counting(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            path = _route_path(scope) if scope.get("root_path") else scope["path"]
            series = by_path.get(path)
            if series is None:
                series = labelled(path)
            status = 500

            async def send_status(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            series.in_flight += 1
            start = clock()
            try:
                await app(scope, receive, send_status)
            finally:
                elapsed = clock() - start
                series.in_flight -= 1
                statuses = series.statuses
                statuses[status] = statuses.get(status, 0) + 1
                series.buckets[bisect_left(bounds, elapsed)] += 1
                series.total += elapsed

        return counting


def _route_path(scope: Scope) -> str:
    """The path the router matches: the request's, less the app's ``root_path`` (servers put
    it in front, as Starlette's ``get_route_path`` takes it off)."""
    path: str = scope["path"]
    root: str = scope["root_path"]
    if path == root:
        return ""
    if path.startswith(root) and path[len(root)] == "/":
        return path[len(root) :]
    return path


def _bucket_bounds(largest: int) -> list[int]:
    bounds = [1]
    while bounds[-1] < largest:
        bounds.append(bounds[-1] * 2)
    return bounds


class StatsCollector(Collector):
    """Prometheus families for every loaded model and mode, built at scrape time."""

    def __init__(
        self,
        clients: Callable[[], Mapping[str, InProcessClient | None]],
        http: HttpCounters,
        *,
        runtime: bool = True,
    ) -> None:
        self._clients = clients
        self._http = http
        if http.models is None:  # its model labels are the models served here
            http.serve(clients())
        #: The process's and interpreter's metrics (``process_*`` where /proc is, on Linux;
        #: ``python_info``; ``python_gc_*`` on CPython), read in with the app's own.
        self._runtime = CollectorRegistry(auto_describe=False)
        if runtime:
            ProcessCollector(registry=self._runtime)
            PlatformCollector(registry=self._runtime)
            GCCollector(registry=self._runtime)

    def collect(self) -> Iterable[Metric]:
        c, g = CounterMetricFamily, GaugeMetricFamily
        batches = _per_mode(c, "batches", "Forward passes run.")
        samples = _per_mode(c, "samples", "Tiles run.")
        batch_size = _per_mode(HistogramMetricFamily, "batch_size", "Tiles per forward pass.")
        depth = _per_mode(g, "queue_depth", "Requests queued for a forward pass now.")
        queue_wait = _per_mode(
            g, "queue_wait_seconds", "Queue wait, quantiles over recent requests.", "quantile"
        )
        forward = _per_mode(
            g, "forward_seconds", "Forward pass time, quantiles over recent batches.", "quantile"
        )
        busy = _per_mode(c, "forward_busy_seconds", "Time spent in forward passes.")
        h = HistogramMetricFamily
        wait_histogram = _per_mode(
            h,
            "queue_wait_duration_seconds",
            "Queue wait of every request that queued (for aggregating).",
        )
        forward_histogram = _per_mode(
            h, "forward_duration_seconds", "Forward pass time of every batch (for aggregating)."
        )
        errors = _per_mode(
            c,
            "errors",
            "Requests failed after admission: a forward pass that raised, a NaN output or a "
            "postprocess failure, a missed deadline.",
        )
        error_kinds = _per_mode(
            c,
            "errors_by_kind",
            "Requests failed after admission, by kind: the exception class, or 'deadline'.",
            "kind",
        )
        cancelled = _per_mode(
            c,
            "cancelled",
            "Requests whose caller left while queued for a forward pass (one that left while "
            "its body was read or decoded is in histoinfer_http_responses_total as 499 only).",
        )
        ready = GaugeMetricFamily(
            "histoinfer_model_ready", "1 once the model is loaded and warmed up.", labels=["model"]
        )
        info = GaugeMetricFamily(
            "histoinfer_model_info",
            "1 for each loaded model: its version, checkpoint and whether its weights are "
            "trained (a dashboard's way to see which replica serves what).",
            labels=["model", "version", "checkpoint_sha256", "trained"],
        )
        for name, client in self._clients().items():
            ready.add_metric([name], 0.0 if client is None else 1.0)
            if client is None:
                continue
            meta = client.server_model.metadata()
            trained = str(meta.trained).lower()
            info.add_metric([name, meta.version, meta.checkpoint_sha256, trained], 1.0)
            for mode, snap in client.stats().items():
                key = [name, mode]
                batches.add_metric(key, snap.batches)
                samples.add_metric(key, snap.samples)
                hist = snap.batch_size_histogram
                buckets = [
                    (str(bound), float(sum(n for size, n in hist.items() if size <= bound)))
                    for bound in _bucket_bounds(client.max_batch_size)
                ]
                buckets.append(("+Inf", float(snap.batches)))
                batch_size.add_metric(key, buckets, sum_value=snap.samples)
                depth.add_metric(key, snap.queue_depth)
                # NaN with nothing measured yet, as Prometheus's own summaries say it: 0.0
                # read on a dashboard as an idle mode's zero latency (a user trial).
                waited, passed = sum(snap.queue_wait_buckets) > 0, snap.batches > 0
                for field, quantile in _QUANTILES:
                    wait_s = snap.queue_wait_ms[field] / 1000.0 if waited else math.nan
                    forward_s = snap.forward_ms[field] / 1000.0 if passed else math.nan
                    queue_wait.add_metric([*key, quantile], wait_s)
                    forward.add_metric([*key, quantile], forward_s)
                busy.add_metric(key, snap.forward_busy_s)
                wait_histogram.add_metric(
                    key, _cumulative(snap.queue_wait_buckets), sum_value=snap.queue_wait_total_s
                )
                forward_histogram.add_metric(
                    key, _cumulative(snap.forward_buckets), sum_value=snap.forward_busy_s
                )
                errors.add_metric(key, snap.errors)
                # "deadline" from the start, at 0: an expression over it (a hung device's
                # alert, docs/server.md) reads no data, not 0, while a series is absent.
                for kind, count in {"deadline": 0, **snap.error_kinds}.items():
                    error_kinds.add_metric([*key, kind], count)
                cancelled.add_metric(key, snap.cancelled)
        yield from (ready, info, batches, samples, batch_size, depth, queue_wait, forward, busy)
        yield from (wait_histogram, forward_histogram)
        yield from (errors, error_kinds, cancelled, *self._http_families())
        yield from self._runtime.collect()

    def _http_families(self) -> tuple[Metric, ...]:
        in_flight = GaugeMetricFamily(
            "histoinfer_http_requests_in_flight",
            "HTTP requests being served now, by route template, model and mode.",
            labels=_LABELS,
        )
        responses = CounterMetricFamily(
            "histoinfer_http_responses",
            "HTTP responses sent, by route template, model, mode and status.",
            labels=[*_LABELS, "status"],
        )
        duration = HistogramMetricFamily(
            "histoinfer_http_request_duration_seconds",
            "HTTP request duration, from the app receiving the request until it has sent the "
            "response, by route template, model and mode.",
            labels=_LABELS,
        )
        held = GaugeMetricFamily(
            "histoinfer_http_request_body_bytes",
            "Bytes of request bodies the server holds now, over every request (bounded by "
            "--max-bodies-mb).",
            value=self._http.bodies_held,
        )
        for series in self._http.series():
            key = list(series.key)
            in_flight.add_metric(key, series.in_flight)
            for status, count in sorted(series.statuses.items()):
                responses.add_metric([*key, str(status)], count)
            duration.add_metric(key, series.cumulative(), sum_value=series.total)
        return in_flight, responses, duration, held


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets from a snapshot's counts per :data:`DURATION_BOUNDS` bucket."""
    running, buckets = 0, []
    for bound, count in zip([*map(str, DURATION_BOUNDS), "+Inf"], counts, strict=True):
        running += count
        buckets.append((bound, float(running)))
    return buckets


def _per_mode(kind: Callable[..., _F], name: str, doc: str, *extra: str) -> _F:
    return kind(f"histoinfer_{name}", doc, labels=["model", "mode", *extra])


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
