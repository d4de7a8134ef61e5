"""The console's dashboard in a real browser (Debian's Chromium through Playwright) against a real
`manage.py serve` (embedded: SQLite, the in-process worker and node): sign in and land on the
dashboard, send real requests with the `openai` SDK (two hitting the cached prefix, one queued,
one refused) and watch the figures redraw as the jobs settle, then reload and read on the page
what the ledger says: `/v1/usage` over the page's own windows, and the jobs' timings from the
database."""

from __future__ import annotations

import sqlite3
from decimal import Decimal
from urllib.parse import quote

import numpy
import openai
import pytest

from tests.e2e.browser import recorded, sign_in
from tests.e2e.stack import ROOT, embedded_server
from tests.e2e.user_path import get_json, wait_for

SCREENSHOT = ROOT / "tests" / "artifacts" / "console-dashboard.png"
SYSTEM = "You review code. Answer in one short sentence. " * 2  # shared: the cache serves it
USAGE_CELLS = {
    "requests": lambda total: str(total["requests"]),
    "prompt_tokens": lambda total: str(total["prompt_tokens"]),
    "cached_tokens": lambda total: str(total["cached_tokens"]),
    "completion_tokens": lambda total: str(total["completion_tokens"]),
    "cache_hit_ratio": lambda total: str(total["cache_hit_ratio"]),
    "spend": lambda total: total["cost"]["total"],
    "savings": lambda total: total["cost"]["cache_savings"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    """Embedded Hearth serving only the tiny model."""
    with embedded_server(tmp_path_factory.mktemp("dashboard"), tiny_llama_dir) as running:
        yield running


def value(page, element_id: str) -> str:
    return page.get_attribute(f"#{element_id}", "data-value")


def usage_between(server, start: str, end: str) -> dict:
    """The ledger's totals over `[start, end)`, as `/v1/usage` reports them."""
    url = f"{server.url}/v1/usage?start={quote(start)}&end={quote(end)}"
    return get_json(url, server.api_key)["total"]


def settled_ttfts(server) -> list[float]:
    """The TTFT of every settled job of the demo org, from the server's database."""
    with sqlite3.connect(server.data_dir / "hearth.sqlite3") as database:
        rows = database.execute(
            "SELECT ttft_s FROM jobs_job JOIN accounts_org ON accounts_org.id = jobs_job.org_id "
            "WHERE accounts_org.slug = 'demo' AND finished_at IS NOT NULL AND ttft_s IS NOT NULL"
        ).fetchall()
    return [ttft for (ttft,) in rows]


def test_the_dashboard_shows_the_ledgers_figures(server, page, browser_log):
    with recorded(page, SCREENSHOT, browser_log, server.output):
        # Signed out, the console sends the browser to its login form, and back to the dashboard.
        sign_in(page, server.url, "/console/", "demo", "demo-password")
        assert page.inner_text("h1").startswith("Dashboard")
        assert value(page, "sum-hour-requests") == "0"
        assert page.locator("#no-errors").count() == 1
        page.wait_for_function("document.getElementById('live-status').textContent === 'live'")
        page.evaluate("window.__marker = 1")  # survives only if the page is never reloaded

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        for index, queue in enumerate([False, False, True]):
            client.chat.completions.create(
                model="tiny",
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"change {index}"},
                ],
                max_tokens=6,
                temperature=0,
                extra_body={"queue": True} if queue else None,
            )
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        # Live: the settled jobs redraw the figures, without a reload.
        page.wait_for_selector('#sum-hour-requests[data-value="3"]')
        assert page.evaluate("window.__marker") == 1
        wait_for(
            lambda: usage_between(server, "2000-01-01", "2100-01-01")["requests"] == 3,
            what="three usage rows",
        )

        page.goto(f"{server.url}/console/?window=hour")
        for window in ("hour", "day", "month"):
            header = page.locator(f"#window-{window}")
            total = usage_between(
                server, header.get_attribute("data-start"), header.get_attribute("data-end")
            )
            assert total["requests"] == 3
            for name, expected in USAGE_CELLS.items():
                assert value(page, f"sum-{window}-{name}") == expected(total), (window, name)
            assert value(page, f"sum-{window}-api_errors") == "1"
            assert value(page, f"sum-{window}-job_errors") == "0"
        assert Decimal(value(page, "sum-hour-savings")) > 0, "no request hit the prefix cache"

        # The charts of the last hour add up to its figures.
        spend = page.locator("#fig-hour-spend rect.spend").evaluate_all(
            "bars => bars.map(bar => bar.dataset.value)"
        )
        assert len(spend) == 60
        assert sum(Decimal(bar) for bar in spend) == Decimal(value(page, "sum-hour-spend"))
        cached = page.locator("#fig-hour-tokens rect.cached").evaluate_all(
            "bars => bars.map(bar => Number(bar.dataset.value))"
        )
        assert sum(cached) == int(value(page, "sum-hour-cached_tokens"))
        refused = page.locator(
            '#fig-hour-errors g.error[data-source="api"][data-code="model_not_found"]'
        )
        assert refused.get_attribute("data-status") == "404"
        assert refused.get_attribute("data-value") == "1"

        # Latency: the median TTFT of the three settled jobs, as the database holds them.
        ttfts = settled_ttfts(server)
        assert len(ttfts) == 3
        shown_p50 = float(value(page, "sum-hour-ttft_p50"))
        assert shown_p50 == pytest.approx(float(numpy.percentile(ttfts, 50)))
        assert page.inner_text("#sum-hour-ttft_p50").endswith("ms")
