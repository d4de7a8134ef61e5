"""The console playground in Chromium against a real embedded `manage.py serve` (SQLite, the tiny
model on an in-process node): a three-turn conversation streams token by token, its cached tokens
rise turn over turn (session affinity on, a system prompt of whole KV blocks), and each turn shows
the cost of its usage row and the node of its job, read from the server's database after the page
closes. "Copy as code" gives the same request; a refused request is shown in the page."""

from __future__ import annotations

import json
import sqlite3
from decimal import Decimal

import pytest

from tests.e2e.browser import open_page, recorded, sign_in
from tests.e2e.stack import ROOT, EmbeddedServer, embedded_server
from tests.e2e.user_path import get_json

SCREENSHOT = ROOT / "tests" / "artifacts" / "console-playground.png"
# Several of the tiny tokenizer's training sentences: well over one 16-token KV block.
SYSTEM = (
    "Paged attention stores keys and values in fixed-size blocks. "
    "Continuous batching admits new requests while others decode."
)
QUESTIONS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Prefix caching lets agents reuse long prompts across turns.",
]
# Counts, per assistant turn, the text nodes its answer gains: one for each streamed delta.
COUNT_DELTAS = """
window.__deltas = [];
new MutationObserver((records) => {
  const turns = Array.from(document.querySelectorAll("#transcript .turn"));
  for (const record of records) {
    const turn = record.target.closest && record.target.closest(".turn");
    if (turn && record.target.classList.contains("content")) {
      const index = turns.indexOf(turn);
      window.__deltas[index] = (window.__deltas[index] || 0) + record.addedNodes.length;
    }
  }
}).observe(document.getElementById("transcript"), {childList: true, subtree: true});
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    """Embedded Hearth serving only the tiny model (a 256-token context, 16-token KV blocks)."""
    with embedded_server(tmp_path_factory.mktemp("playground"), tiny_llama_dir) as running:
        yield running


def ledger(server: EmbeddedServer, request_ids: list[str]) -> dict[str, tuple[Decimal, str]]:
    """Each request's usage row total and its job's node, from the server's own database."""
    with sqlite3.connect(server.data_dir / "hearth.sqlite3") as database:
        rows = database.execute(
            "SELECT u.request_id, u.total_cost, j.node FROM billing_usagerecord u "
            "JOIN jobs_job j ON j.request_id = u.request_id "
            f"WHERE u.request_id IN ({','.join('?' * len(request_ids))})",
            request_ids,
        ).fetchall()
    # SQLite keeps a decimal column as a number: its shortest repr is the exact decimal.
    return {request_id: (Decimal(str(total)), node) for request_id, total, node in rows}


def test_a_three_turn_conversation_streams_and_shows_what_the_ledger_billed(server, browser_log):
    with open_page(browser_log) as page:
        shown = converse(page, server, browser_log)
    request_ids = [turn["request_id"] for turn in shown]
    billed = ledger(server, request_ids)
    assert sorted(billed) == sorted(request_ids)
    for turn in shown:
        total, node = billed[turn["request_id"]]
        assert Decimal(turn["cost"].removeprefix("$")) == total, turn
        assert turn["node"] == node == "embedded-tiny", turn
        # The API says the same of the job (the demo key's org is the console key's).
        job = get_json(f"{server.url}/v1/jobs/{turn['job_id']}", server.api_key)
        assert job["request_id"] == turn["request_id"] and Decimal(job["cost"]["total"]) == total
        usage = job["usage"]
        assert turn["prompt"] == usage["prompt_tokens"]
        assert turn["cached"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert turn["completion"] == usage["completion_tokens"]


def converse(page, server: EmbeddedServer, browser_log: list[str]) -> list[dict]:
    """Three turns in the page; what each turn shows."""
    with recorded(page, SCREENSHOT, browser_log, server.output):
        sign_in(page, server.url, "/console/playground", "demo", "demo-password")
        page.select_option("#model", "tiny")
        page.fill("#system", SYSTEM)
        page.fill("#temperature", "0")
        page.fill("#top-p", "0.9")
        page.fill("#max-tokens", "8")
        page.fill("#seed", "7")
        assert page.is_checked("#affinity")
        page.evaluate(COUNT_DELTAS)

        for number, question in enumerate(QUESTIONS, start=1):
            page.fill("#message", question)
            page.click("#send")
            settled = "#transcript .turn[data-state=settled]"
            page.wait_for_function(f"document.querySelectorAll('{settled}').length === {number}")
        turns = [read_turn(turn) for turn in page.locator("#transcript .turn").all()]

        deltas = page.evaluate("window.__deltas")
        assert len(deltas) == 3 and all(count >= 2 for count in deltas), deltas
        for turn in turns:
            assert turn["completion"] >= 2 and turn["ttft"].endswith(" ms)"), turn
            assert turn["tps"] != "\u2014", turn
        cached = [turn["cached"] for turn in turns]
        assert cached[0] < cached[1] < cached[2], turns
        assert all(turn["cached"] % 16 == 0 for turn in turns), turns  # whole blocks

        # Copy as code: the last turn's request, with the model and the whole conversation.
        python = page.inner_text("#code-python")
        assert 'model="tiny"' in python and '"content": "Paged attention' in python
        assert all(repr_json(q) in python for q in QUESTIONS), python
        assert 'api_key=os.environ["HEARTH_API_KEY"]' in python
        assert "temperature=0," in python and "max_tokens=8," in python
        assert f'"x-session-affinity": "{page.inner_text("#conversation-id")}"' in python
        page.click("[data-code=curl]")
        curl = page.inner_text("#code-curl")
        assert '"model": "tiny"' in curl and "Bearer $HEARTH_API_KEY" in curl
        assert all(repr_json(q) in curl for q in QUESTIONS), curl
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
        page.click("#copy-code")
        page.wait_for_function("document.getElementById('copy-status').textContent === 'Copied.'")
        assert page.evaluate("navigator.clipboard.readText()") == curl
        assert server.api_key not in python + curl + page.content()

        # A request the API refuses: its message in the page, the question back in the composer.
        page.fill("#temperature", "5")
        page.fill("#message", "One more?")
        page.click("#send")
        page.wait_for_selector("#error:not([hidden])")
        assert (
            page.inner_text("#error") == "'temperature' must be in [0.0, 2.0], got 5. (temperature)"
        )
        assert page.input_value("#message") == "One more?"
        assert page.locator("#transcript .turn").count() == 3
        return turns


def repr_json(text: str) -> str:
    """`text` as both the Python and the curl code write it: a JSON string."""
    return json.dumps(text)


def read_turn(turn) -> dict:
    def stat(name: str) -> str:
        return turn.locator(f".stats .{name}").inner_text().strip()

    return {
        "request_id": turn.get_attribute("data-request-id"),
        "job_id": turn.get_attribute("data-job-id"),
        "prompt": int(stat("prompt-tokens")),
        "cached": int(stat("cached-tokens")),
        "completion": int(stat("completion-tokens")),
        "cost": stat("cost"),
        "ttft": stat("ttft"),
        "tps": stat("tps"),
        "node": stat("node"),
    }
