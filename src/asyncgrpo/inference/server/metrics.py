"""`GET /metrics` in Prometheus's text format, one registry per application.

Both servers (`asyncgrpo serve` and `asyncgrpo tinker-serve`) count their requests by
route, method and status, with a latency histogram per route (`HttpMetrics`, fed by
`request_log.RequestObserver`); each adds what it knows: the engine's token counters and
queue here (`EngineCollector`), the Tinker service's futures, queues and models there.
Each application has a registry of its own, never the process-wide default, so that two
servers in one process (tests, a notebook) keep apart.

Why the route needs no token: it only reads, it says how much and how fast (counts,
latencies, queue depths and the ids of the models queued), never a prompt, a completion,
a weight or a key, and a scraper (Prometheus) is simplest to point at a route without
credentials; both servers bind to loopback unless told otherwise. What changes state stays
behind the admin token (`serve`) or the API key (`tinker-serve`).

`prometheus-client` comes with the `tinker` and `dev` extras; without it, `serve` still
logs every request and its `/metrics` answers 501 saying what to install.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.responses import PlainTextResponse, Response

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError:  # the core install; the `tinker` and `dev` extras bring it
    prometheus_client = None

# seconds; a Tinker future's long-poll is answered within 40 s, a generation may stream longer
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MISSING = (
    "GET /metrics needs the prometheus-client package: pip install prometheus-client "
    "(or asyncgrpo[tinker])"
)


def available() -> bool:
    return prometheus_client is not None


def new_registry():
    """A registry of this application's own (None without prometheus-client)."""
    return prometheus_client.CollectorRegistry(auto_describe=True) if available() else None


class HttpMetrics:
    """Requests by route template, method and status; latency by route."""

    def __init__(self, registry):
        self.requests = prometheus_client.Counter(
            "asyncgrpo_http_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.seconds = prometheus_client.Histogram(
            "asyncgrpo_http_request_duration_seconds",
            "Time from a request's arrival to the end of its response, by route template",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.seconds.labels(route).observe(seconds)


class StateCollector:
    """A collector whose families are computed at each scrape by `read()`, a function
    yielding metric families (prometheus-client's custom-collector protocol)."""

    def __init__(self, read: Callable[[], Iterable]):
        self._read = read

    def collect(self):
        yield from self._read()

    def describe(self):
        return []  # computed at scrape time: nothing to check for duplicates up front


ENGINE_COUNTERS = {
    "generated_tokens": ("asyncgrpo_engine_generated_tokens", "Tokens the engine sampled"),
    "prompt_tokens": ("asyncgrpo_engine_prompt_tokens", "Prompt tokens the engine admitted"),
    "cached_prompt_tokens": (
        "asyncgrpo_engine_cached_prompt_tokens",
        "Admitted prompt tokens read from the prefix cache",
    ),
    "busy_seconds": ("asyncgrpo_engine_busy_seconds", "Seconds the engine spent working"),
}
ENGINE_GAUGES = {
    "running": ("asyncgrpo_engine_running_requests", "Requests decoding now"),
    "prefilling": ("asyncgrpo_engine_prefilling_requests", "Requests in prefill now"),
    "waiting": ("asyncgrpo_engine_waiting_requests", "Requests queued for the engine"),
    "weight_version": ("asyncgrpo_engine_weight_version", "Version of the weights loaded"),
}


def engine_families(engine) -> Iterable:
    """The engine's `stats()` as families: counters (rate() of generated tokens is the
    engine's tokens/s) and gauges; a stat the engine does not report is left out."""
    stats = engine.stats()
    for key, (name, doc) in ENGINE_COUNTERS.items():
        if isinstance(stats.get(key), int | float):
            yield CounterMetricFamily(name, doc, value=stats[key])
    for key, (name, doc) in ENGINE_GAUGES.items():
        if isinstance(stats.get(key), int | float):
            yield GaugeMetricFamily(name, doc, value=stats[key])


def metrics_response(registry) -> Response:
    if registry is None:
        return PlainTextResponse(MISSING, status_code=501)
    return Response(
        prometheus_client.generate_latest(registry),
        media_type=prometheus_client.CONTENT_TYPE_LATEST,
    )
