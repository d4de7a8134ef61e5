"""The web console in a real browser (Debian's Chromium through Playwright) against a real
`manage.py serve`: sign in, create a key and read its secret once, then watch a job submitted
with the `openai` SDK appear in the jobs table and turn completed, live, without a reload."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.browser import recorded, sign_in
from tests.e2e.stack import ROOT, embedded_server
from tests.e2e.user_path import get_json

SCREENSHOT = ROOT / "tests" / "artifacts" / "console-jobs.png"
STATUS_ORDER = ["queued", "running", "completed"]
WATCH_ROWS = """
window.__statuses = {};
new MutationObserver(() => {
  for (const row of document.querySelectorAll('#jobs tbody tr[id^="job-"]')) {
    const seen = (window.__statuses[row.id] ||= []);
    if (seen[seen.length - 1] !== row.dataset.status) seen.push(row.dataset.status);
  }
}).observe(document.querySelector('#jobs tbody'),
           {childList: true, subtree: true, attributes: true});
"""


@pytest.fixture
def server(tmp_path, tiny_llama_dir):
    """Embedded Hearth serving only the tiny model."""
    with embedded_server(tmp_path, tiny_llama_dir) as running:
        yield running


def cell_texts(page, row_selector: str) -> list[str]:
    return [text.strip() for text in page.locator(f"{row_selector} td").all_inner_texts()]


def test_it_shows_a_job_from_the_api_completing_live(server, page, browser_log):
    with recorded(page, SCREENSHOT, browser_log, server.output):
        # Signed out, the console sends the browser to its login form, and back after it.
        sign_in(page, server.url, "/console/keys", "demo", "demo-password")

        # A new key's secret is shown once, then only its prefix.
        page.fill("#id_name", "browser test")
        page.click("#create-key button[type=submit]")
        secret = page.inner_text("#new-key-secret").strip()
        assert secret.startswith("hk_")
        page.goto(f"{server.url}/console/keys")
        assert page.locator("#new-key-secret").count() == 0
        assert secret not in page.content()
        assert f"{secret[: len('hk_') + 12]}_…" in page.content()

        page.goto(f"{server.url}/console/jobs")
        page.wait_for_function("document.getElementById('live-status').textContent === 'live'")
        # Survives only if the page is never reloaded.
        page.evaluate("window.__marker = 1")
        # Every status each job row shows, in order, as the live updates change the table.
        page.evaluate(WATCH_ROWS)

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0)
        queued = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello from the browser test"}],
            max_tokens=8,
            temperature=0,
            extra_body={"queue": True},
        )
        assert queued.http_response.status_code == 202
        job_id = queued.http_response.json()["id"]

        row = f'[id="job-{job_id}"]'
        page.wait_for_selector(row)
        page.wait_for_selector(f'{row}[data-status="completed"]')
        assert page.evaluate("window.__marker") == 1
        seen = page.evaluate(f"window.__statuses['job-{job_id}']")
        assert seen[-1] == "completed" and seen == sorted(seen, key=STATUS_ORDER.index), seen

        # The live row says what the API says about the job.
        job = get_json(f"{server.url}/v1/jobs/{job_id}", secret)
        assert job["status"] == "completed"
        usage = job["usage"]
        cells = cell_texts(page, row)
        assert cells[:9] == [
            job_id,
            "completed",
            "tiny",
            "async",
            str(usage["prompt_tokens"]),
            str(usage["prompt_tokens_details"]["cached_tokens"]),
            str(usage["completion_tokens"]),
            job["cost"]["total"],
            job["node"],
        ]
        assert page.locator("#jobs tbody tr").first.get_attribute("id") == f"job-{job_id}"
