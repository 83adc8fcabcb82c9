"""Merge the Prometheus texts of several replicas into one exposition, each sample labelled by its replica."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_metrics(texts: Mapping[str, str], extra: str = "") -> bytes:
    """One Prometheus text from `{replica id: its /metrics text}`: the samples of every replica, with a
    `replica` label added, grouped under one HELP/TYPE per metric; `extra` (metrics of the ingress) is
    appended to the families as it is."""
    families: dict[str, Metric] = {}

    def add(text: str, replica: str | None) -> None:
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                labels = dict(s.labels) if replica is None else {REPLICA_LABEL: replica, **s.labels}
                merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)

    for replica in sorted(texts):
        add(texts[replica], replica)
    if extra:
        add(extra, None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))  # type: ignore[arg-type]
    return generate_latest(registry)
