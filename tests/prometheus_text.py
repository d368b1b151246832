"""Prometheus text, read back as a scrape reads it (the metrics tests of the worker and the API)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict, name: str, **labels: str) -> float:
    """The sum of the samples named `name` that carry these labels (at least one must)."""
    hits = [v for (n, ls), v in found.items() if n == name and all((k, v_) in ls for k, v_ in labels.items())]
    assert hits, (name, labels)
    return sum(hits)
