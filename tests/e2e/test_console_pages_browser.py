"""The console's fleet, job and batch pages in Chromium, on one production stack for the module
(gateway, worker and real node processes on the tiny model): a node joins the fleet page live,
then, killed, turns stale and leaves it; a queued job is cancelled from its page, which then
shows it cancelled with its timeline; a batch's page shows its progress and downloads its output.

The stack lives for the whole module, its rows committed by the module's fixture and flushed at
its end, as a transactional test's are; each test runs in a transaction of its own that it never
writes in (the django_db mark: without one pytest-django would not create the test database for
this module alone), and reads Hearth through its API. Each test has a browser of its own.
"""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace

import openai
import pytest
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command

from controlplane.accounts.models import ApiKey, Membership, Org
from tests.controlplane.conftest import priced_model
from tests.e2e.browser import sign_in
from tests.e2e.conftest import production_stack
from tests.e2e.stack import ROOT
from tests.e2e.user_path import get_json

pytestmark = pytest.mark.django_db

ARTIFACTS = ROOT / "tests" / "artifacts"
PASSWORD = "fleet-password"
# Every state the watched row shows, in order, and whether it was there at all (a row removed
# after it was seen is recorded as "gone").
WATCH_ROW = """
(rowId) => {
  window.__states = [];
  const record = (state) => {
    if (window.__states[window.__states.length - 1] !== state) window.__states.push(state);
  };
  new MutationObserver(() => {
    const row = document.getElementById(rowId);
    if (row) record(row.dataset.state);
    else if (window.__states.length) record("gone");
  }).observe(document.querySelector("#fleet tbody"),
             {childList: true, subtree: true, attributes: true});
}
"""


@pytest.fixture(scope="module")
def console(django_db_setup, django_db_blocker, tiny_llama_dir, tmp_path_factory):
    """Gateway, worker and one node (of a model of this run's own) on the shared Redis, a second
    model that no node serves, and a developer of the org to sign in as."""
    redis_url = settings.DRAMATIQ_BROKER["OPTIONS"]["url"]
    run = os.getpid()
    with django_db_blocker.unblock():
        org = Org.objects.create(slug="acme", name="Acme")
        _, key = ApiKey.objects.create_key(org, "e2e")
        user = get_user_model().objects.create_user("dev", password=PASSWORD)
        Membership.objects.create(org=org, user=user, role="developer")
        served = priced_model(f"tiny-{run}", str(tiny_llama_dir), 256).id
        idle = priced_model(f"tiny-idle-{run}", str(tiny_llama_dir), 256).id
    stack = production_stack(redis_url, tmp_path_factory.mktemp("console-pages"))
    try:
        stack.start_gateway()
        stack.start_worker()
        node_a = f"fleet-a-{run}"
        stack.start_node(served, node_a, threads=1)
        stack.wait_ready(served, nodes=1, api_key=key)
        yield SimpleNamespace(
            stack=stack,
            sdk=openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0),
            key=key,
            served=served,
            idle=idle,
            node_a=node_a,
        )
    finally:
        stack.stop()
        client = redis.Redis.from_url(redis_url)
        for key_name in client.scan_iter(match=f"{stack.env['HEARTH_BROKER_NAMESPACE']}*"):
            client.delete(key_name)
        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture
def browser(console, page, browser_log):
    """A fresh browser signed in as the org's developer. At the end it saves a screenshot of its
    page as `page.shot` when the test named one, and prints what the browser logged and the
    processes' output unless the test cleared `page.failed`."""
    sign_in(page, console.stack.url, "/console/fleet", "dev", PASSWORD)
    page.shot = None
    page.failed = True
    yield page
    if page.shot:
        save_screenshot(page, page.shot)
    if page.failed:
        print("--- browser console\n" + "\n".join(browser_log) + "\n" + console.stack.outputs())


def save_screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_the_fleet_page_shows_a_node_join_then_go_stale_and_leave(console, browser):
    page, stack = browser, console.stack
    node_b = f"fleet-b-{os.getpid()}"
    page.goto(f"{stack.url}/console/fleet")
    page.wait_for_selector(f'[id="node-{console.node_a}"][data-state="live"]')
    page.evaluate("window.__marker = 1")  # survives only if the page is never reloaded
    page.evaluate(WATCH_ROW, f"node-{node_b}")

    stack.start_node(console.served, node_b, threads=1)
    row = f'[id="node-{node_b}"]'
    page.wait_for_selector(f'{row}[data-state="live"]', timeout=120_000)
    cells = [text.strip() for text in page.locator(f"{row} td").all_inner_texts()]
    assert cells[:3] == [node_b, console.served, "unified"]
    used, free, total = (int(cell) for cell in cells[3:6])
    assert total > 0 and used + free == total
    save_screenshot(page, "console-fleet.png")  # both nodes live

    # Killed, it beats no more: stale once a beat is missed, gone when its beat expires.
    stack.processes[f"node-{node_b}"].kill()
    page.wait_for_selector(row, state="detached", timeout=30_000)
    # (A beat late by more than half an interval on a busy machine shows stale, then live again.)
    states = page.evaluate("window.__states")
    assert states[0] == "live" and states[-2:] == ["stale", "gone"], states
    assert page.evaluate("window.__marker") == 1
    page.wait_for_selector(f'[id="node-{console.node_a}"][data-state="live"]')
    page.failed = False


def test_a_queued_job_is_cancelled_from_its_page(console, browser):
    page, stack = browser, console.stack
    page.shot = "console-job.png"
    # No node serves this model: the job waits in the queue until it is cancelled.
    queued = console.sdk.chat.completions.with_raw_response.create(
        model=console.idle,
        messages=[{"role": "user", "content": "write a long story"}],
        max_tokens=200,
        extra_body={"queue": True},
    )
    job_id = queued.http_response.json()["id"]

    # From the jobs table to the job's page.
    page.goto(f"{stack.url}/console/jobs")
    page.click(f'[id="job-{job_id}"] a')
    page.wait_for_url(f"{stack.url}/console/jobs/{job_id}")
    page.wait_for_function("document.getElementById('live-status').textContent === 'live'")
    assert page.get_attribute("#job-status", "data-status") == "queued"
    assert "write a long story" in page.inner_text("#request")
    # The parameters as received, in their folded <details>.
    assert json.loads(page.text_content("#request-parameters"))["max_tokens"] == 200

    page.click("#cancel-form button")
    page.wait_for_selector('#job-status[data-status="cancelled"]')
    timeline = page.locator("#timeline tbody tr").evaluate_all(
        "rows => rows.map(row => row.dataset.type)"
    )
    assert timeline == ["job.queued", "job.cancelled"]
    assert page.locator("#cancel-form").count() == 0
    assert get_json(f"{stack.url}/v1/jobs/{job_id}", console.key)["status"] == "cancelled"
    page.failed = False


def test_a_batch_page_shows_its_progress_and_downloads_its_output(console, browser):
    page, stack, sdk = browser, console.stack, console.sdk
    page.shot = "console-batch.png"
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": console.served,
                "messages": [{"role": "user", "content": f"count to {n}"}],
                "max_tokens": 4,
                "temperature": 0,
            },
        }
        for n in range(3)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = sdk.files.create(file=("lines.jsonl", io.BytesIO(content)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    page.goto(f"{stack.url}/console/batches")
    page.click(f'[id="batch-{batch.id}"] a')
    page.wait_for_url(f"{stack.url}/console/batches/{batch.id}")
    # Live: the page follows the batch until it ends.
    page.wait_for_selector('#batch-status[data-status="completed"]', timeout=90_000)
    assert page.inner_text("#progress-text") == "3 of 3 settled (100 %)"
    assert page.get_attribute("#progress-bar", "style") == "width: 100%"
    counts = [page.inner_text(f"#count-{n}") for n in ("total", "completed", "failed")]
    assert counts == ["3", "3", "0"]

    finished = sdk.batches.retrieve(batch.id)
    with page.expect_download() as download:
        page.click("#file-output a.download")
    path = download.value.path()
    downloaded = path.read_bytes()
    assert downloaded == sdk.files.content(finished.output_file_id).content
    custom_ids = sorted(json.loads(line)["custom_id"] for line in downloaded.splitlines())
    assert custom_ids == ["line-0", "line-1", "line-2"]

    page.goto(f"{stack.url}/console/batches")
    assert page.get_attribute(f'[id="batch-{batch.id}"]', "data-status") == "completed"
    assert page.inner_text(f'[id="batch-{batch.id}"] .percent') == "100 %"
    page.goto(f"{stack.url}/console/batches/{batch.id}")
    page.failed = False
