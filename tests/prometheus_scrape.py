"""`GET /metrics` read as Prometheus reads it: parsed by prometheus_client's own parsers, so a
test fails on output a scraper would refuse as well as on a wrong value."""

from __future__ import annotations

import urllib.request

from prometheus_client import parser
from prometheus_client.openmetrics import parser as openmetrics_parser


def route_samples(text: str, content_type: str = "text/plain") -> dict[tuple[str, str, str], float]:
    """{(series, model, decision): value} of every `hearth_route_*` sample in `text`: the text
    format or, when `content_type` says so, OpenMetrics."""
    if content_type.startswith("application/openmetrics-text"):
        families = openmetrics_parser.text_string_to_metric_families(text)
    else:
        families = parser.text_string_to_metric_families(text)
    return {
        (sample.name, sample.labels["model"], sample.labels["decision"]): sample.value
        for family in families
        if family.name.startswith("hearth_route_")
        for sample in family.samples
    }


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels as a frozenset of (name, value) pairs): value} of every sample in
    `text` (the text format): `_bucket`, `_count` and `_sum` samples of histograms included."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in parser.text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """The samples (`samples`) a scrape of `url` returns now."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return samples(response.read().decode())


def value(scraped: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float | None:
    """The value of sample `name` with exactly `labels`; None when it is not there."""
    return scraped.get((name, frozenset(labels.items())))
