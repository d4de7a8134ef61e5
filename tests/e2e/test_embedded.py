"""Embedded mode: the same user path against one `manage.py serve` process (SQLite, in-process
Dramatiq worker on the StubBroker, in-memory channel layer, in-process node)."""

from __future__ import annotations

import sqlite3

import pytest

from tests.e2e.stack import EmbeddedServer
from tests.e2e.user_path import exercise_user_path, get_json, wait_for


@pytest.fixture
def embedded(tmp_path, tiny_llama_dir):
    server = EmbeddedServer(tmp_path, "tiny", tiny_llama_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_openai_sdk_drives_embedded_mode(embedded):
    try:
        request_ids = exercise_user_path(embedded.url, embedded.api_key, "tiny", "embedded-tiny")
    except Exception:
        print(embedded.output())
        raise
    database = sqlite3.connect(embedded.data_dir / "hearth.sqlite3")

    def usage_rows() -> list[tuple]:
        marks = ",".join("?" * len(request_ids))
        return database.execute(
            "SELECT u.request_id, u.prompt_tokens, u.cached_tokens, u.completion_tokens, j.status "
            "FROM billing_usagerecord u JOIN jobs_job j ON j.request_id = u.request_id "
            f"WHERE u.request_id IN ({marks})",
            request_ids,
        ).fetchall()

    wait_for(lambda: len(usage_rows()) == len(request_ids), what="every usage row")
    [[total]] = database.execute("SELECT COUNT(*) FROM billing_usagerecord").fetchall()
    assert total == len(request_ids)
    assert all(row[-1] == "completed" for row in usage_rows())

    # The usage report and the month's invoice count them too (SQLite keeps the daily sums with
    # triggers, which a migration that rebuilds the ledger's table must restore).
    [[prompt, completion]] = database.execute(
        "SELECT SUM(prompt_tokens), SUM(completion_tokens) FROM billing_usagerecord"
    ).fetchall()
    report = get_json(f"{embedded.url}/v1/usage?group_by=model", embedded.api_key)
    assert report["total"]["requests"] == len(request_ids)
    assert (report["total"]["prompt_tokens"], report["total"]["completion_tokens"]) == (
        prompt,
        completion,
    )
    [invoice] = get_json(f"{embedded.url}/v1/invoices", embedded.api_key)["data"]
    assert invoice["requests"] == len(request_ids)
