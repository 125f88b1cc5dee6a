"""A prometheus-client registry to wire data and back, with the labels that say where it came from.

    service registry ──registry_families──▶ [MetricFamilyData] ──▶ MetricsReport (wire)
    reports of every instance ──export_families──▶ [Metric] (one per name, every instance's samples)

Invariants:
- A sample is passed on as prometheus-client produced it (cumulative counters and buckets, ``le``
  labels), so a histogram re-exported from N instances is N labelled histograms whose buckets
  ``sum by (le)`` adds up exactly; nothing is resampled or merged lossily.
- Every exported sample carries ``service`` and ``replica`` (not ``instance`` or ``job``: Prometheus
  sets those per scrape target and would rename ours). Labels the service set itself win.
- Families that share a name across reports become one family; a report whose family has the same
  name but another type is left out (one type per name, or the exposition is invalid).
- ``_created`` samples (prometheus-client's process-start timestamps) are not sent.

No asyncio, no NATS: tested synchronously.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from shared.wire.messages import MetricFamilyData, MetricSample, MetricsReport

SERVICE_LABEL = "service"
REPLICA_LABEL = "replica"


def registry_families(registry: CollectorRegistry) -> list[MetricFamilyData]:
    families = []
    for metric in registry.collect():
        samples = [
            MetricSample(name=s.name, labels=dict(s.labels), value=float(s.value))
            for s in metric.samples
            if not s.name.endswith("_created")
        ]
        families.append(
            MetricFamilyData(
                name=metric.name,
                type=metric.type,
                documentation=metric.documentation,
                samples=samples,
            )
        )
    return families


def export_families(reports: Iterable[MetricsReport]) -> list[Metric]:
    """Every report's families as prometheus-client Metrics, labelled by service and replica, in
    the order the names first appear."""
    merged: dict[str, Metric] = {}
    for report in reports:
        origin = {SERVICE_LABEL: report.service, REPLICA_LABEL: report.instance}
        for family in report.families:
            metric = merged.get(family.name)
            if metric is None:
                metric = merged[family.name] = Metric(
                    family.name, family.documentation, family.type
                )
            elif metric.type != family.type:
                continue
            for s in family.samples:
                metric.add_sample(s.name, {**origin, **s.labels}, s.value)
    return list(merged.values())
