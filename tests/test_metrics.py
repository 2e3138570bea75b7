"""``/metrics``' HTTP families: responses, requests in flight and request durations by route
template, model and mode, with bounded label values whatever paths clients send; and the
process's own metrics in the app's registry. On asyncio and trio."""

from __future__ import annotations

import json
import random
import string
import sys
from typing import Any

import anyio
import httpx
import pytest
from concurrency_helpers import gated_model
from helpers import make_body, request_dict, serving
from prometheus_client.parser import text_string_to_metric_families
from test_server_app import leave_mid_body

from histoinfer import InProcessClient
from histoinfer.schema import MODES
from histoinfer.server import create_app

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SINGLE, BATCH = "/api/{mode}/{model}", "/api/{mode}/{model}/batch"
METADATA, STATS, OTHER = "/api/metadata/{model}", "/api/stats/{model}", "other"
ROUTES = {SINGLE, BATCH, METADATA, STATS, OTHER, "/invocations", "/metrics"}
ROUTES |= {"/health/live", "/health/ready", "/ping"}
Labels = tuple[str, ...]


def fresh_client(model: Any) -> InProcessClient:
    return InProcessClient(model, max_batch_size=8, max_wait_ms=5.0, overload="reject")


async def scrape(http: httpx.AsyncClient) -> dict[str, dict[Labels, float]]:
    """``/metrics`` as {sample name: {(route, model, mode[, status][, le]): value}} for the
    ``histoinfer_http_*`` samples, {sample name: {(): value}} for the others' unlabelled ones."""
    r = await http.get("/metrics")
    assert r.status_code == 200
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            names = ("route", "model", "mode", "status", "le") if "http" in s.name else ()
            key = tuple(s.labels[n] for n in names if n in s.labels)
            out.setdefault(s.name, {})[key] = s.value
    return out


def responses(m: dict[str, dict[Labels, float]], *skip: str) -> dict[Labels, float]:
    """Response counts by (route, model, mode, status), less the routes in ``skip``."""
    counts = m.get("histoinfer_http_responses_total", {})
    return {k: v for k, v in counts.items() if k[0] not in skip}


def two_models(tiny_model: Any) -> Any:
    return create_app({"h1": fresh_client(tiny_model), "h2": fresh_client(tiny_model)})


async def test_responses_by_route_model_mode_and_status(tiny_model):
    """A 404 (unknown model), 422 or 400 is tied to its route, model and mode; metadata and
    stats polls, probes and scrapes are counted apart from inference."""
    async with serving(two_models(tiny_model)) as http:
        before = responses(await scrape(http))
        assert {k[0] for k in before} <= {"/health/ready", "/metrics"}  # readiness polls
        for path, body, status in [
            ("/api/predict/h1", make_body(1), 200),
            ("/api/predict/h1", make_body(2), 200),
            ("/api/embed/h2", make_body(3), 200),
            ("/api/predict/h1", "{bad", 422),
            ("/api/predict/h9", make_body(1), 404),  # a model not served here
            ("/api/classify/h2", "{}", 400),  # not a mode
            ("/api/predict_with_embedding/h2/batch", json.dumps([make_body(4)]), 200),
            ("/api/embed/h1/batch", "[{", 422),
            ("/invocations", json.dumps(request_dict(5, model_name="h2", mode="embedding")), 200),
        ]:
            r = await http.post(path, content=body)
            assert r.status_code == status, (path, r.text)
        for path, status in [
            ("/api/metadata/h1", 200),
            ("/api/metadata/h1", 200),
            ("/api/metadata/h9", 404),
            ("/api/stats/h2", 200),
            ("/health/live", 200),
            ("/no/such/route", 404),
        ]:
            assert (await http.get(path)).status_code == status, path
        after = await scrape(http)
    assert responses(after, "/health/ready", "/metrics") == {
        (SINGLE, "h1", "predict", "200"): 2.0,
        (SINGLE, "h2", "embed", "200"): 1.0,
        (SINGLE, "h1", "predict", "422"): 1.0,
        (SINGLE, "unknown", "predict", "404"): 1.0,
        (SINGLE, "h2", "unknown", "400"): 1.0,
        (BATCH, "h2", "predict_with_embedding", "200"): 1.0,
        (BATCH, "h1", "embed", "422"): 1.0,
        ("/invocations", "", "", "200"): 1.0,  # its model and mode are in its body, unread
        (METADATA, "h1", "", "200"): 2.0,
        (METADATA, "unknown", "", "404"): 1.0,
        (STATS, "h2", "", "200"): 1.0,
        ("/health/live", "", "", "200"): 1.0,
        (OTHER, "", "", "404"): 1.0,
    }
    scrapes = responses(after)[("/metrics", "", "", "200")]
    assert scrapes == before.get(("/metrics", "", "", "200"), 0) + 1  # not the one in flight
    # Nothing is in flight now but the scrape that reads the gauge.
    in_flight = {k: v for k, v in after["histoinfer_http_requests_in_flight"].items() if v}
    assert in_flight == {("/metrics", "", ""): 1.0}


async def test_the_duration_histogram_counts_every_response(tiny_model):
    async with serving(two_models(tiny_model)) as http:
        for i in range(3):
            assert (await http.post("/api/predict/h2", content=make_body(i))).status_code == 200
        assert (await http.post("/api/embed/h1", content="{bad")).status_code == 422
        assert (await http.get("/api/metadata/h2")).status_code == 200
        m = await scrape(http)
    count = m["histoinfer_http_request_duration_seconds_count"]
    total = m["histoinfer_http_request_duration_seconds_sum"]
    buckets = m["histoinfer_http_request_duration_seconds_bucket"]
    by_series: dict[Labels, float] = {}
    for (route, model, mode, _status), n in m["histoinfer_http_responses_total"].items():
        by_series[route, model, mode] = by_series.get((route, model, mode), 0) + n
    # One observation a response, in each (route, model, mode); the scrape itself, in flight,
    # has a series with none yet.
    assert {k: n for k, n in count.items() if n} == by_series
    assert count[SINGLE, "h2", "predict"] == 3 and count[SINGLE, "h1", "embed"] == 1
    assert count[METADATA, "h2", ""] == 1
    bounds = ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5"]
    bounds += ["1.0", "2.5", "5.0", "10.0", "25.0", "60.0", "+Inf"]  # 1 ms to 60 s
    for series, n in count.items():
        cumulative = [buckets[(*series, le)] for le in bounds]
        assert cumulative == sorted(cumulative) and cumulative[-1] == n, series
        assert (total[series] > 0) == (n > 0)
    assert total[SINGLE, "h2", "predict"] < 60 * 3


async def test_requests_in_flight_by_route_model_and_mode(tiny_model):
    model, watch, gate = gated_model(tiny_model)
    app = create_app({"h1": fresh_client(model)}, warmup=False)
    async with serving(app) as http:
        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:

                    async def held() -> None:
                        r = await http.post("/api/embed/h1/batch", content=f"[{make_body(1)}]")
                        assert r.status_code == 200

                    tg.start_soon(held)
                    while watch.calls < 1:  # in its forward pass, held at the gate
                        await anyio.sleep(0.01)
                    during = (await scrape(http))["histoinfer_http_requests_in_flight"]
                    gate.set()
        finally:
            gate.set()
        after = (await scrape(http))["histoinfer_http_requests_in_flight"]
    assert {k: v for k, v in during.items() if v} == {
        (BATCH, "h1", "embed"): 1.0,
        ("/metrics", "", ""): 1.0,
    }
    assert after[BATCH, "h1", "embed"] == 0.0


async def test_a_client_leaving_is_counted_as_499_of_its_model_and_mode(tiny_model):
    app = two_models(tiny_model)
    async with serving(app) as http:
        sent = await leave_mid_body(app, "/api/predict_with_embedding/h2")
        assert sent[0]["status"] == 499
        m = await scrape(http)
    assert responses(m, "/health/ready", "/metrics") == {
        (SINGLE, "h2", "predict_with_embedding", "499"): 1.0
    }


def random_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + "_-", k=rng.randint(1, 12)))


def scanner_paths(rng: random.Random, n: int) -> list[str]:
    """Paths a vulnerability scanner or a confused client might try: all different."""
    shapes = [
        "/{a}",
        "/{a}/{b}",
        "/api/{a}",
        "/api/{a}/{b}",
        "/api/{a}/{b}/batch",
        "/api/{a}/{b}/{c}",
        "/api/predict/{a}",
        "/api/metadata/{a}",
        "/api/{a}/h1",
        "/health/{a}",
        "/invocations/{a}",
        "/metrics/{a}",
        "/.{a}/../{b}",
    ]
    return [
        rng.choice(shapes).format(a=random_name(rng), b=random_name(rng), c=random_name(rng))
        for _ in range(n)
    ]


async def test_scanner_paths_make_no_new_label_values(tiny_model):
    """A raw path is never a label value: random paths land in a few fixed series (route
    ``other``, model or mode ``unknown``), however many there are."""
    rng = random.Random(1234)
    async with serving(create_app({"h1": fresh_client(tiny_model)})) as http:

        async def scan(n: int) -> set[Labels]:
            for path in scanner_paths(rng, n):
                if rng.random() < 0.5:
                    r = await http.post(path, content=b"{}")
                else:
                    r = await http.get(path)
                assert r.status_code >= 400, path
            return set(responses(await scrape(http), "/metrics", "/health/ready"))

        first = await scan(150)
        second = await scan(150)
        m = await scrape(http)
    assert second == first  # 150 more random paths: not one new series
    for name in (
        "histoinfer_http_responses_total",
        "histoinfer_http_request_duration_seconds_count",
    ):
        labels = set(m[name])
        assert {k[0] for k in labels} <= ROUTES
        assert {k[1] for k in labels} <= {"h1", "unknown", ""}
        assert {k[2] for k in labels} <= {*MODES, "unknown", ""}
    counted = responses(m, "/health/ready", "/metrics")
    assert sum(counted.values()) == 300  # each counted, under a bounded label set
    assert counted.get((OTHER, "", "", "404"), 0) > 50
    assert any(k[:3] == (SINGLE, "unknown", "unknown") for k in counted)
    assert any(k[:3] == (SINGLE, "h1", "unknown") for k in counted)


async def test_label_values_of_paths():
    """The middleware alone, around a trivial app: each path's (route, model, mode),
    ``root_path`` taken off as the router takes it off."""
    from histoinfer.server.metrics import HttpCounters

    counters = HttpCounters(["h1", "big-model"])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def nothing() -> Any:
        return {"type": "http.request", "body": b""}

    async def drop(message: Any) -> None:
        pass

    counting = counters.middleware(app)
    cases = {
        "/api/predict/h1": (SINGLE, "h1", "predict"),
        "/api/embed/big-model/batch": (BATCH, "big-model", "embed"),
        "/api/predict_with_embedding/zz": (SINGLE, "unknown", "predict_with_embedding"),
        "/api/x/h1/batch": (BATCH, "h1", "unknown"),
        "/api/metadata/big-model": (METADATA, "big-model", ""),
        "/api/stats/nope": (STATS, "unknown", ""),
        "/api/metadata/h1/batch": (BATCH, "h1", "unknown"),
        "/api/predict/h1/": (OTHER, "", ""),
        "/api/predict/h1/batch/x": (OTHER, "", ""),
        "/api//h1": (OTHER, "", ""),
        "/invocations": ("/invocations", "", ""),
        "/api/models": ("/api/models", "", ""),
        "/health/ready": ("/health/ready", "", ""),
        "/ping": ("/ping", "", ""),
        "/metrics": ("/metrics", "", ""),
        "/": (OTHER, "", ""),
    }
    for path, labels in cases.items():
        for root in ("", "/prefix"):
            scope = {"type": "http", "path": root + path, "root_path": root}
            await counting(scope, nothing, drop)
        got = {s.key: sum(s.statuses.values()) for s in counters.series()}
        assert got.get(labels, 0) >= 2, (path, got)
    assert {s.key for s in counters.series()} == set(cases.values())
    await counting({"type": "lifespan"}, nothing, drop)  # not HTTP: not counted
    assert counters.responses == {204: 2 * len(cases)} and counters.in_flight == 0


async def test_model_info_names_each_loaded_models_version_and_checkpoint(tiny_model):
    """Which replica serves what, for a dashboard (an evaluator coming from Triton)."""
    async with serving(create_app({"h1": fresh_client(tiny_model)})) as http:
        text = (await http.get("/metrics")).text
    meta = tiny_model.metadata()
    [line] = [x for x in text.splitlines() if x.startswith("histoinfer_model_info{")]
    assert f'checkpoint_sha256="{tiny_model.checkpoint.sha256}"' in line
    assert f'version="{meta.version}"' in line and 'model="h1"' in line
    assert f'trained="{str(meta.trained).lower()}"' in line and line.endswith(" 1.0")


async def test_process_and_python_metrics_are_in_the_apps_registry(tiny_model):
    async with serving(create_app({"h1": fresh_client(tiny_model)})) as http:
        m = await scrape(http)
    assert "python_info" in m
    if sys.implementation.name == "cpython":
        assert "python_gc_collections_total" in m
    if sys.platform.startswith("linux"):
        assert m["process_cpu_seconds_total"][()] > 0
        assert m["process_resident_memory_bytes"][()] > 0
        assert "process_open_fds" in m and "process_start_time_seconds" in m
