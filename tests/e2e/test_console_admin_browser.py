"""The console's members and webhooks pages in a real browser (Debian's Chromium through
Playwright) against one embedded `manage.py serve`: the demo owner adds a billing viewer and a
developer, whose roles then shut them out of keys and billing; the owner adds a webhook endpoint
(a real receiver in this process), reads its secret once, and a job's completion arrives signed
and shows up among the deliveries."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.browser import sign_in
from tests.e2e.stack import ROOT, embedded_server

ARTIFACTS = ROOT / "tests" / "artifacts"
OWNER = ("demo", "demo-password")
BILL = ("bill", "bill-password")
DEV = ("dev", "dev-password")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    """Embedded Hearth serving the tiny model, webhooks to loopback allowed, with two user
    accounts that belong to no org yet."""
    accounts = (
        "from django.contrib.auth import get_user_model\n"
        f"get_user_model().objects.create_user({BILL[0]!r}, password={BILL[1]!r})\n"
        f"get_user_model().objects.create_user({DEV[0]!r}, password={DEV[1]!r})"
    )
    with embedded_server(
        tmp_path_factory.mktemp("console-admin"),
        tiny_llama_dir,
        setup=accounts,
        HEARTH_WEBHOOK_ALLOW_PRIVATE="1",
    ) as running:
        yield running


def invite(page, username: str, role: str) -> None:
    page.fill("#id_username", username)
    page.select_option("#id_role", role)
    with page.expect_navigation():
        page.click("#invite-member button[type=submit]")


def sign_in_again(page, server, path: str, user: tuple[str, str]) -> None:
    page.context.clear_cookies()  # signed out
    sign_in(page, server.url, path, *user)


def wait_until(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_roles_given_on_the_members_page_limit_what_each_member_sees(server, page, browser_log):
    try:
        sign_in(page, server.url, "/console/members", *OWNER)
        invite(page, BILL[0], "billing")
        invite(page, DEV[0], "developer")
        assert page.get_attribute('#members tr[data-username="bill"]', "data-role") == "billing"
        assert page.get_attribute('#members tr[data-username="dev"]', "data-role") == "developer"
        invite(page, "nobody", "developer")
        assert "There is no user named “nobody”." in page.inner_text("#invite-member")
        page.goto(f"{server.url}/console/members")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-members.png"), full_page=True)

        # The billing viewer: no keys in the nav, the 403 page at their address; the list only.
        sign_in_again(page, server, "/console/members", BILL)
        assert page.inner_text("#my-role") == "Billing viewer"
        nav = page.locator("header nav a").all_inner_texts()
        assert "API keys" not in nav and "Billing" in nav and "Members" in nav
        assert page.locator("#invite-member").count() == 0
        response = page.goto(f"{server.url}/console/keys")
        assert response.status == 403
        assert "Billing viewer" in page.inner_text("#forbidden")

        # The developer: keys yes, billing no.
        sign_in_again(page, server, "/console/keys", DEV)
        assert "Billing" not in page.locator("header nav a").all_inner_texts()
        response = page.goto(f"{server.url}/console/billing")
        assert response.status == 403
        assert "Developer" in page.inner_text("#forbidden")
    except BaseException:
        print(f"--- manage.py serve output\n{server.output()}")
        print("--- browser console\n" + "\n".join(browser_log))
        raise


def test_a_webhook_endpoint_gets_a_jobs_completion(server, page, browser_log, receiver):
    try:
        sign_in(page, server.url, "/console/webhooks", *OWNER)
        page.fill("#id_url", receiver.url)
        page.fill("#id_description", "browser test")
        page.check('#create-endpoint input[value="job.completed"]')
        page.click("#create-endpoint button[type=submit]")
        secret = page.inner_text("#new-endpoint-secret").strip()
        assert secret.startswith("whsec_")
        page.goto(f"{server.url}/console/webhooks")
        assert page.locator("#new-endpoint-secret").count() == 0 and secret not in page.content()
        endpoint_row = page.locator("#endpoints tbody tr").first
        assert endpoint_row.get_attribute("data-enabled") == "true"
        assert receiver.url in endpoint_row.inner_text()

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        queued = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello from the webhooks test"}],
            max_tokens=4,
            temperature=0,
            extra_body={"queue": True},
        )
        job_id = queued.http_response.json()["id"]

        # The receiver gets the completion, signed with the secret shown once.
        [event] = wait_until(lambda: receiver.verified(secret), "the webhook")
        assert event["type"] == "job.completed" and event["data"]["id"] == job_id

        def delivery_listed():
            page.goto(f"{server.url}/console/webhooks")
            row = page.locator('#deliveries tbody tr[data-status="succeeded"]')
            return row.count() == 1 and row

        row = wait_until(delivery_listed, "the delivery's row")
        assert row.get_attribute("id").startswith("delivery-whd_")
        assert event["id"] in row.inner_text() and "job.completed" in row.inner_text()
        assert row.locator("td.http-status").inner_text() == "200"
        assert row.locator("td.attempt").inner_text() == "1"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-webhooks.png"), full_page=True)
    except BaseException:
        print(f"--- manage.py serve output\n{server.output()}")
        print("--- browser console\n" + "\n".join(browser_log))
        raise
