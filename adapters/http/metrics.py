"""`/metrics`: the engine's metrics table (`paged_backend.engine.metrics_table`) in Prometheus' text format.

Values are read from `AsyncLLMEngine.get_stats()` at scrape time. vLLM-named metrics carry vLLM's
`model_name` label (the served name), as vLLM's own server exports them. Each app has its own
`CollectorRegistry`, so several servers in one process do not clash.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from paged_backend import (COUNTER, GAUGE, INFO, METRICS, STATE, AsyncLLMEngine, MetricSpec, histogram,
                           info_labels, labelled_values, state_value, value)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector:
    """Every metric of the table, read from the engine's statistics at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine, self._model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.get_stats()
        for spec in METRICS:
            labels = {"model_name": self._model_name} if spec.is_vllm else {}
            yield self._family(spec, stats, labels)

    @staticmethod
    def _family(spec: MetricSpec, stats, labels: dict) -> Metric:
        names, values = list(labels), list(labels.values())
        if spec.kind == GAUGE:
            family = GaugeMetricFamily(spec.name, spec.help, labels=names)
            family.add_metric(values, value(spec, stats))
        elif spec.kind in (INFO, STATE):
            info = info_labels(spec, stats)
            family = GaugeMetricFamily(spec.name, spec.help, labels=names + list(info))
            family.add_metric(values + list(info.values()), 1.0 if spec.kind == INFO else state_value(stats))
        elif spec.kind == COUNTER:
            family = CounterMetricFamily(spec.name, spec.help, labels=names + ([spec.label] if spec.label else []))
            if spec.label:
                for label_value, count in labelled_values(spec, stats):
                    family.add_metric(values + [label_value], count)
            else:
                family.add_metric(values, value(spec, stats))
        else:
            snapshot = histogram(spec, stats)
            family = HistogramMetricFamily(spec.name, spec.help, labels=names)
            family.add_metric(values, [(bound, float(n)) for bound, n in snapshot.cumulative()], snapshot.sum)
        return family


class ServerMetrics:
    """The registry behind `/metrics` for one app."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str = "model") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
