"""The engine's metrics table (`paged_backend.engine.metrics_table`) as Triton custom metrics, on Triton's /metrics.

The same names as the HTTP server's `/metrics`, ours and vLLM's (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ...), labelled with `model` and `version` as Triton's vLLM backend
labels them. Gauges are set; counters grow by their change since the last update (Triton counters only go
up); histograms replay the observations made since the last update (Triton histograms can only observe).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from paged_backend import (COUNTER, GAUGE, HISTOGRAM, HISTOGRAM_BUCKETS, INFO, METRICS, STATE, EngineStats,
                           MetricSpec, histogram, info_labels, labelled_values, state_value, value)


class TritonEngineMetrics:
    """One Triton metric family per table entry; `update(stats)` publishes a snapshot."""

    def __init__(self, pb_utils: Any, labels: Dict[str, str]) -> None:
        kinds = {GAUGE: pb_utils.MetricFamily.GAUGE, COUNTER: pb_utils.MetricFamily.COUNTER,
                 HISTOGRAM: pb_utils.MetricFamily.HISTOGRAM, INFO: pb_utils.MetricFamily.GAUGE,
                 STATE: pb_utils.MetricFamily.GAUGE}
        self._labels = labels
        self._families: List[Any] = []
        self._info_families: Dict[str, Any] = {}  # INFO metrics get their labels from the first snapshot
        # (spec, label value or None) -> metric
        self._metrics: Dict[Tuple[str, Optional[str]], Any] = {}
        self._last: Dict[Tuple[str, Optional[str]], float] = {}
        self._states: Dict[str, str] = {}   # STATE metric -> its current label set
        for spec in METRICS:
            family = pb_utils.MetricFamily(name=spec.sample_name, description=spec.help, kind=kinds[spec.kind])
            self._families.append(family)
            if spec.kind in (INFO, STATE):
                self._info_families[spec.name] = family
            elif spec.label:
                for label_value in spec.label_values:
                    self._metrics[(spec.name, label_value)] = family.Metric(labels={**labels, spec.label: label_value})
            elif spec.kind in (GAUGE, COUNTER):
                self._metrics[(spec.name, None)] = family.Metric(labels=labels)
            else:
                self._metrics[(spec.name, None)] = family.Metric(labels=labels,
                                                                 buckets=list(HISTOGRAM_BUCKETS[spec.source]))

    def update(self, stats: EngineStats) -> None:
        """Set gauges that changed; add the growth of each counter; observe new histogram values."""
        for spec in METRICS:
            if spec.kind == GAUGE:
                self._set((spec.name, None), value(spec, stats))
            elif spec.kind == INFO:
                self._set_info(spec, stats)
            elif spec.kind == STATE:
                self._set_state(spec, stats)
            elif spec.kind == COUNTER and spec.label:
                for label_value, count in labelled_values(spec, stats):
                    self._grow((spec.name, label_value), count)
            elif spec.kind == COUNTER:
                self._grow((spec.name, None), value(spec, stats))
            else:
                self._observe(spec, stats)

    def _set(self, key, current: float) -> None:
        if self._last.get(key) != current:
            self._metrics[key].set(current)
            self._last[key] = current

    def _set_info(self, spec: MetricSpec, stats: EngineStats) -> None:
        key = (spec.name, None)
        if key not in self._metrics:
            labels = {**self._labels, **info_labels(spec, stats)}
            self._metrics[key] = self._info_families[spec.name].Metric(labels=labels)
            self._metrics[key].set(1.0)

    def _set_state(self, spec: MetricSpec, stats: EngineStats) -> None:
        """The series of the current labels is set to the snapshot's time when they change (earlier label sets
        keep their older times, as in vLLM, so the newest series is the current state)."""
        labels = info_labels(spec, stats)
        key = (spec.name, "\0".join(f"{k}={v}" for k, v in sorted(labels.items())))
        if self._states.get(spec.name) == key[1]:
            return
        if key not in self._metrics:
            self._metrics[key] = self._info_families[spec.name].Metric(labels={**self._labels, **labels})
        self._metrics[key].set(state_value(stats))
        self._states[spec.name] = key[1]

    def _grow(self, key, current: float) -> None:
        delta = current - self._last.get(key, 0.0)
        if delta > 0:
            self._metrics[key].increment(delta)
            self._last[key] = current

    def _observe(self, spec: MetricSpec, stats: EngineStats) -> None:
        key = (spec.name, None)
        snapshot = histogram(spec, stats)
        seen = int(self._last.get(key, 0))
        for observed in snapshot.new_values(seen):
            self._metrics[key].observe(observed)
        self._last[key] = snapshot.count

    def close(self) -> None:
        """Drop the metrics before their families (the order Triton requires)."""
        self._metrics.clear()
        self._families.clear()


def create_metrics(pb_utils: Any, labels: Dict[str, str], logger: Any = None) -> Optional[TritonEngineMetrics]:
    """The metrics, or None when the server runs without metrics (`--allow-metrics=false`)."""
    try:
        return TritonEngineMetrics(pb_utils, labels)
    except Exception as exc:  # noqa: BLE001 - pb_utils raises TritonModelException when metrics are off
        if logger is not None:
            logger.log_info(f"[paged_backend] custom metrics unavailable: {exc}")
        return None
