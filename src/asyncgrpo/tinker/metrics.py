"""What `GET /metrics` of `asyncgrpo tinker-serve` says about the Tinker service.

Beside the request counters every server has (`asyncgrpo.inference.server.metrics`):
how long operations take to run, observed as each ends (forward, forward_backward,
optim_step on the trainer; sample on the engine, its wait for the engine's weights
included), the tokens sampled (whose rate is the engine's tokens/s for Tinker clients),
and, read from the service at each scrape, the futures pending, each model's queue depth
(operations queued or running in its `seq_id` order), the models resident in memory and
those offloaded to disk (`--max-resident-models`), the sets of sampler weights offloaded,
how many times each kind was offloaded and reloaded, the samplers, and the sessions live
and ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from asyncgrpo.inference.server.metrics import LATENCY_BUCKETS


class TinkerMetrics:
    """The Tinker service's metrics, a prometheus-client collector: register it in an
    application's registry."""

    def __init__(self, service):
        self.service = service
        self._own = prometheus_client.CollectorRegistry(auto_describe=True)
        self.operation_seconds = prometheus_client.Histogram(
            "asyncgrpo_tinker_operation_seconds",
            "Running time of Tinker operations, by operation",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=self._own,
        )
        self.sampled_tokens = prometheus_client.Counter(
            "asyncgrpo_tinker_sampled_tokens",
            "Tokens sampled for Tinker sample requests",
            registry=self._own,
        )

    @contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.operation_seconds.labels(operation).observe(time.perf_counter() - start)

    def describe(self):
        return []  # the state families are computed at scrape time

    def collect(self):
        yield from self._own.collect()
        svc = self.service
        yield GaugeMetricFamily(
            "asyncgrpo_tinker_futures_pending",
            "Operations submitted and not yet finished",
            value=svc.futures.pending,
        )
        depth = GaugeMetricFamily(
            "asyncgrpo_tinker_model_queue_depth",
            "Operations of a model queued or running in its seq_id order",
            labels=["model"],
        )
        for model_id, waiting in svc.queue_depths().items():
            depth.add_metric([model_id], waiting)
        yield depth
        yield GaugeMetricFamily(
            "asyncgrpo_tinker_resident_models",
            "Training models in memory (adapter and optimizer state)",
            value=svc.resident_models(),
        )
        yield GaugeMetricFamily(
            "asyncgrpo_tinker_offloaded_models",
            "Training models offloaded to disk beyond --max-resident-models",
            value=len(svc.offload.offloaded),
        )
        yield GaugeMetricFamily(
            "asyncgrpo_tinker_offloaded_sampler_weights",
            "Sets of sampler weights offloaded to disk beyond --max-resident-models",
            value=svc.snapshots.offloaded_count(),
        )
        yield from offload_counters(svc)
        yield GaugeMetricFamily(
            "asyncgrpo_tinker_samplers", "Sampling sessions in memory", value=len(svc.samplers)
        )
        yield GaugeMetricFamily(
            "asyncgrpo_tinker_sessions_live", "Sessions alive", value=len(svc.sessions.live)
        )
        ended = CounterMetricFamily(
            "asyncgrpo_tinker_sessions_ended",
            "Sessions ended, by how: expired (no word for --session-ttl) or closed",
            labels=["how"],
        )
        for how, count in svc.sessions.ended_total.items():
            ended.add_metric([how], count)
        yield ended


def offload_counters(svc):
    """Offloads to disk and reloads from it, by what moved: a model or sampler weights."""
    moved = {"model": svc.offload, "sampler_weights": svc.snapshots}
    for name, what in (("offloads", "Offloads to disk"), ("reloads", "Reloads from disk")):
        family = CounterMetricFamily(
            f"asyncgrpo_tinker_{name}",
            f"{what} beyond --max-resident-models, by kind",
            labels=["kind"],
        )
        for kind, keeper in moved.items():
            family.add_metric([kind], getattr(keeper, name))
        yield family
