"""`GET /metrics` read as Prometheus reads it: parsed by prometheus_client's own parsers, so a
test fails on output a scraper would refuse as well as on a wrong value."""

from __future__ import annotations

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
