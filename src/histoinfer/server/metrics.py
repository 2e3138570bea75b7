"""``GET /metrics``: Prometheus text read from ``client.stats()`` at scrape time.

The schedulers already keep thread-safe statistics (batch-size histogram, queue wait and forward
percentiles, errors, live queue depth); a custom collector reads them when Prometheus scrapes,
so the request path does no extra bookkeeping for metrics. Each app has its own registry: two
apps in one process (tests, several models) never collide in a global one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ..clients.inprocess import InProcessClient

__all__ = ["HttpCounters", "StatsCollector", "render_metrics"]

_F = TypeVar("_F", bound=Metric)
_QUANTILES = (("p50", "0.5"), ("p95", "0.95"), ("p99", "0.99"))

# Only these paths count as inference traffic (health checks and scrapes are not load).
_INFERENCE_PREFIXES = ("/api/", "/invocations")


class HttpCounters:
    """In-flight inference requests and responses by status, kept by a pure ASGI middleware.

    Updated only on the server's event loop, so plain ints need no lock.
    """

    def __init__(self) -> None:
        self.in_flight = 0
        self.responses: Counter[int] = Counter()

    def middleware(self, app: ASGIApp) -> ASGIApp:
        counters = self

        async def counting(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or not scope["path"].startswith(_INFERENCE_PREFIXES):
                await app(scope, receive, send)
                return
            status = 500

            async def send_status(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            counters.in_flight += 1
            try:
                await app(scope, receive, send_status)
            finally:
                counters.in_flight -= 1
                counters.responses[status] += 1

        return counting


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
    ) -> None:
        self._clients = clients
        self._http = http

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
        errors = _per_mode(c, "errors", "Forward passes that raised.")
        error_kinds = _per_mode(c, "errors_by_kind", "Errors by exception class.", "kind")
        cancelled = _per_mode(c, "cancelled", "Requests cancelled while queued.")
        ready = GaugeMetricFamily(
            "histoinfer_model_ready", "1 once the model is loaded and warmed up.", labels=["model"]
        )
        for name, client in self._clients().items():
            ready.add_metric([name], 0.0 if client is None else 1.0)
            if client is None:
                continue
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
                for field, quantile in _QUANTILES:
                    queue_wait.add_metric([*key, quantile], snap.queue_wait_ms[field] / 1000.0)
                    forward.add_metric([*key, quantile], snap.forward_ms[field] / 1000.0)
                busy.add_metric(key, snap.forward_busy_s)
                errors.add_metric(key, snap.errors)
                for kind, count in snap.error_kinds.items():
                    error_kinds.add_metric([*key, kind], count)
                cancelled.add_metric(key, snap.cancelled)
        in_flight = GaugeMetricFamily(
            "histoinfer_http_requests_in_flight", "Inference requests being served now."
        )
        in_flight.add_metric([], self._http.in_flight)
        responses = CounterMetricFamily(
            "histoinfer_http_responses", "Inference responses sent, by status.", labels=["status"]
        )
        for status, count in sorted(self._http.responses.items()):
            responses.add_metric([str(status)], count)
        yield from (ready, batches, samples, batch_size, depth, queue_wait, forward, busy)
        yield from (errors, error_kinds, cancelled, in_flight, responses)


def _per_mode(kind: Callable[..., _F], name: str, doc: str, *extra: str) -> _F:
    return kind(f"histoinfer_{name}", doc, labels=["model", "mode", *extra])


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
