"""`GET /v1/events` (SSE) and `/ws/events?after=` through the whole ASGI application, on the real
PostgreSQL: a resumed stream gets every missed event of its own org once, in order, then the
live ones; nothing of another org, ever."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlencode

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import connection, transaction

from controlplane.events import stream
from controlplane.events.models import EMIT_LOCK_NAMESPACE, Event
from controlplane.events.push import bind_loop, org_group
from inference.protocol import delta_publisher
from tests.controlplane.test_events_ws import communicator, run, session_cookie
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

emit = database_sync_to_async(Event.objects.emit)


@pytest.fixture(autouse=True)
def memory_layer(settings):
    """The in-memory channel layer, dropped again after the test (see test_events_ws.py)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def quick_keepalive(monkeypatch) -> None:
    """A keepalive every 0.2 s: a stream's first one tells that it is live (`live`)."""
    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.2)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    """`wait_for` from the event loop; `condition` may read the database. In a thread of its
    own, not the thread-sensitive one: once a test has used Django's test client, which
    reconnects `close_old_connections` to `request_started` for every sender, an API request
    runs that receiver there, and waiting in it would hold up the very request it waits for."""

    def wait() -> None:
        try:
            wait_for(condition, what, timeout_s)
        finally:
            connection.close()

    await sync_to_async(wait, thread_sensitive=False)()


def lock_waits(locktype: str, **keys: int) -> int:
    """How many lock requests of `locktype` wait in this database, matching pg_locks' `keys`
    (`relation`, or an advisory lock's `classid` and `objid`)."""
    where = "".join(f" AND {column} = %s" for column in keys)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = %s AND database = "
            f"(SELECT oid FROM pg_database WHERE datname = current_database()){where}",
            [locktype, *keys.values()],
        )
        return cursor.fetchone()[0]


def reads_waiting() -> int:
    """How many statements wait for a lock on the events' table."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::regclass::oid", [Event._meta.db_table])
        [table] = cursor.fetchone()
    return lock_waits("relation", relation=table)


class EventsTableLock(threading.Thread):
    """A transaction, in a thread of its own, that holds the events' table in ACCESS EXCLUSIVE
    mode (every read of the log waits for it) from `held` until `release`, then runs
    `before_commit` in it and commits."""

    def __init__(self, before_commit: Callable[[], object] = lambda: None) -> None:
        super().__init__()
        self.held, self.release = threading.Event(), threading.Event()
        self.before_commit = before_commit

    def run(self) -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(f"LOCK TABLE {Event._meta.db_table} IN ACCESS EXCLUSIVE MODE")
                self.held.set()
                assert self.release.wait(10)
                self.before_commit()
        finally:
            connection.close()


async def hand_over(held: EventsTableLock, to: EventsTableLock) -> None:
    """The stream's read waits for `held`: queue `to` behind it and release `held`. PostgreSQL
    grants locks in the order asked, so the read runs, then `to` takes the table, and the
    stream's next read waits for `to`."""
    await until(lambda: reads_waiting() == 1, "the stream's read to wait for the table")
    to.start()
    await until(lambda: reads_waiting() == 2, "the next lock to queue behind the stream's read")
    held.release.set()
    assert await sync_to_async(to.held.wait)(10)


KEEPALIVE = ": keepalive"


class EventStreamClient(ApplicationCommunicator):
    """An HTTP client speaking ASGI to the application: `GET /v1/events`, read frame by frame."""

    def __init__(self, key: str | None, query: dict | None = None, **headers: str) -> None:
        from controlplane.asgi import application

        raw_headers = [(b"host", b"127.0.0.1:8000")]
        if key is not None:
            raw_headers.append((b"authorization", f"Bearer {key}".encode()))
        for name, value in headers.items():
            raw_headers.append((name.replace("_", "-").lower().encode(), value.encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": "/v1/events",
            "raw_path": b"/v1/events",
            "query_string": urlencode(query or {}).encode(),
            "headers": raw_headers,
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        super().__init__(application, scope)
        self.buffer = b""

    async def request(self) -> None:
        await self.send_input({"type": "http.request", "body": b"", "more_body": False})

    async def open(self) -> tuple[int, dict[str, str]]:
        """Send the request; the response's status and headers."""
        await self.request()
        start = await self.receive_output(5)
        assert start["type"] == "http.response.start", start
        return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}

    async def error(self) -> dict:
        """The JSON body of a refused request."""
        body = await self.receive_output(5)
        return json.loads(body["body"])["error"]

    async def next_frame(self, timeout: float = 3) -> str:
        while b"\n\n" not in self.buffer:
            message = await self.receive_output(timeout)
            assert message["type"] == "http.response.body", message
            self.buffer += message["body"]
        frame, self.buffer = self.buffer.split(b"\n\n", 1)
        return frame.decode()

    async def live(self) -> None:
        """Wait until the stream is live (with `quick_keepalive`): a stream without `after`
        sends its first keepalive once it has joined its org's group and found the log's end,
        so from then on every event emitted reaches it."""
        assert await self.next_frame() == KEEPALIVE

    async def next_event(self, timeout: float = 3) -> dict:
        """The next event within `timeout`, keepalives skipped: checks the SSE fields agree
        with the JSON it carries."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        frame = await self.next_frame(timeout)
        while frame == KEEPALIVE:
            assert loop.time() < end, "keepalives, and no event"
            frame = await self.next_frame(end - loop.time())
        fields = dict(line.split(": ", 1) for line in frame.split("\n"))
        event = json.loads(fields["data"])
        assert (fields["id"], fields["event"]) == (event["id"], event["type"])
        return event

    async def next_ids(self, count: int) -> list[str]:
        return [(await self.next_event())["id"] for _ in range(count)]

    async def nothing_more(self, timeout: float = 0.3) -> bool:
        """Whether no event comes within `timeout` (keepalives may)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while b"\n\n" in self.buffer or not await self.receive_nothing(max(0, end - loop.time())):
            if await self.next_frame() != KEEPALIVE:
                return False
        return True

    async def close(self) -> None:
        await self.send_input({"type": "http.disconnect"})
        await self.wait(5)


async def emit_many(org, count: int, type: str = "job.queued") -> list[str]:
    return [(await emit(org, type, {"n": n})).id for n in range(count)]


def test_it_streams_only_new_events_of_the_keys_org(org_a, org_b, key_a, quick_keepalive):
    async def scenario():
        await emit_many(org_a, 2)  # before the stream: not sent without `after`
        client = EventStreamClient(key_a)
        status, headers = await client.open()
        assert status == 200
        assert headers["content-type"] == "text/event-stream"
        assert headers["cache-control"] == "no-cache"
        assert headers["x-accel-buffering"] == "no"
        await client.live()
        # Globex's event first: had it leaked, it would be the first frame read.
        await emit(org_b, "job.queued", {"id": "job_globex"})
        ours = await emit(org_a, "job.completed", {"id": "job_acme"})
        assert await client.next_event() == {
            "id": ours.id,
            "object": "event",
            "type": "job.completed",
            "created": int(ours.created.timestamp()),
            "data": {"id": "job_acme"},
        }
        assert await client.nothing_more()
        await client.close()

    run(scenario)


@pytest.mark.parametrize("resume_with", ["last_event_id", "after"])
def test_it_resumes_with_every_missed_event_once_then_live_ones(org_a, org_b, key_a, resume_with):
    async def scenario():
        seen = await emit_many(org_a, 2)
        await emit_many(org_b, 2)
        missed = await emit_many(org_a, 3)
        if resume_with == "after":
            client = EventStreamClient(key_a, {"after": seen[-1]})
        else:
            client = EventStreamClient(key_a, Last_Event_ID=seen[-1])
        assert (await client.open())[0] == 200
        assert await client.next_ids(3) == missed
        live = await emit_many(org_a, 3)
        assert await client.next_ids(3) == live
        assert await client.nothing_more()
        await client.close()

    run(scenario)


def test_last_event_id_wins_over_after(org_a, key_a):
    """A browser's EventSource reconnects to the URL it was given, with the header set."""

    async def scenario():
        ids = await emit_many(org_a, 4)
        client = EventStreamClient(key_a, {"after": ids[0]}, Last_Event_ID=ids[2])
        assert (await client.open())[0] == 200
        assert await client.next_ids(1) == [ids[3]]
        assert await client.nothing_more()
        await client.close()

    run(scenario)


def test_events_committed_while_the_backlog_is_read_arrive_once_in_order(org_a, key_a, monkeypatch):
    """The backlog is read two events a query. After the first query, two events commit (their
    pushes wait in the stream's channel): each is sent once, after the backlog, in order. The
    stream's reads are held in that order by locks on the events' table, handed from one
    transaction to the next (`hand_over`)."""
    monkeypatch.setattr(stream, "READ_BATCH", 2)
    during_backlog: list[str] = []

    def emit_two() -> None:
        during_backlog.extend(
            Event.objects.emit(org_a, "job.running", {"n": n}).id for n in range(2)
        )

    locks = [EventsTableLock(), EventsTableLock(), EventsTableLock(before_commit=emit_two)]

    async def scenario():
        first, *backlog = await emit_many(org_a, 6)
        locks[0].start()
        assert await sync_to_async(locks[0].held.wait)(10)
        client = EventStreamClient(key_a, {"after": first})
        await client.request()
        await hand_over(locks[0], locks[1])  # `first` found; the org's group joined
        await hand_over(locks[1], locks[2])  # the backlog's first query done
        locks[2].release.set()  # commits the two events; the backlog's second query goes on
        start = await client.receive_output(5)
        assert start["status"] == 200
        assert await client.next_ids(7) == backlog + during_backlog
        live = await emit_many(org_a, 1)
        assert await client.next_ids(1) == live
        assert await client.nothing_more()
        await client.close()

    try:
        run(scenario)
    finally:
        for lock in locks:
            lock.release.set()
            if lock.is_alive():
                lock.join(10)


def test_it_filters_by_types(org_a, key_a):
    async def scenario():
        (start,) = await emit_many(org_a, 1)
        await emit(org_a, "job.queued", {})
        failed = await emit(org_a, "job.failed", {})
        client = EventStreamClient(key_a, {"after": start, "types": "job.completed, job.failed"})
        assert (await client.open())[0] == 200
        assert await client.next_ids(1) == [failed.id]
        await emit(org_a, "job.running", {})
        completed = await emit(org_a, "job.completed", {})
        assert await client.next_ids(1) == [completed.id]
        assert await client.nothing_more()
        await client.close()

    run(scenario)


def closed_port() -> int:
    """A local TCP port nothing listens on: connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_lost_push_is_made_good_at_the_keepalive(org_a, key_a, settings, caplog, monkeypatch):
    """The stream's layer works; the process that writes the event cannot reach its Redis (a
    closed port), so the event's push is lost. The stream reads the event at a keepalive."""
    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.3)
    caplog.set_level(logging.WARNING, logger=delta_publisher.logger.name)

    def push_failed() -> bool:
        return any(r.getMessage().startswith("delta not delivered") for r in caplog.records)

    async def scenario():
        client = EventStreamClient(key_a)
        assert (await client.open())[0] == 200
        await client.live()  # its layer taken: the in-memory one
        settings.CHANNEL_LAYERS = {
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {"hosts": [f"redis://127.0.0.1:{closed_port()}"]},
            }
        }
        bind_loop(asyncio.get_running_loop())  # pushes start again, on that layer
        unannounced = await emit(org_a, "job.completed", {})
        # Never pushed, it is read at the next keepalive (or the one after, had it committed
        # while the stream read the log at the last one).
        assert (await client.next_event(timeout=1))["id"] == unannounced.id
        await until(push_failed, "the push to fail")
        await client.close()

    run(scenario)


def test_it_leaves_the_orgs_group_when_the_client_goes(org_a, key_a, quick_keepalive):
    async def scenario():
        client = EventStreamClient(key_a)
        assert (await client.open())[0] == 200
        await client.live()
        layer = get_channel_layer()
        assert len(layer.groups.get(org_group(org_a.pk), {})) == 1
        await client.close()
        assert not layer.groups.get(org_group(org_a.pk))

    run(scenario)


@pytest.mark.parametrize("key", [None, "hk_0123456789ab_" + "x" * 43])
def test_it_refuses_a_missing_or_wrong_key(db, key):
    async def scenario():
        client = EventStreamClient(key)
        assert (await client.open())[0] == 401
        error = await client.error()
        assert error["type"] == "invalid_request_error"
        assert error["code"] in {"missing_api_key", "invalid_api_key"}
        await client.wait(5)

    run(scenario)


@pytest.mark.parametrize("whose", ["unknown", "another_orgs"])
def test_it_refuses_to_resume_after_an_event_not_of_the_org(org_a, org_b, key_a, whose):
    async def scenario():
        theirs = await emit(org_b, "job.completed", {"secret": True})
        after = theirs.id if whose == "another_orgs" else "evt_000000000000000000000000"
        for client in (
            EventStreamClient(key_a, {"after": after}),
            EventStreamClient(key_a, Last_Event_ID=after),
        ):
            assert (await client.open())[0] == 400
            error = await client.error()
            assert (error["param"], error["code"]) == ("after", "unknown_event")
            assert "secret" not in json.dumps(error)
            await client.wait(5)

    run(scenario)


def test_the_console_socket_replays_what_it_missed_then_goes_live(org_a, org_b):
    cookie = session_cookie("alice", org_a)

    async def scenario():
        seen = await emit_many(org_a, 1)
        await emit_many(org_b, 1)
        missed = await emit_many(org_a, 3)
        socket = communicator(cookie)
        socket.scope["query_string"] = f"after={seen[0]}".encode()
        assert (await socket.connect())[0]
        assert [(await socket.receive_json_from())["id"] for _ in missed] == missed
        live = await emit_many(org_a, 2)
        assert [(await socket.receive_json_from())["id"] for _ in live] == live
        assert await socket.receive_nothing(timeout=0.3)
        await socket.disconnect()

    run(scenario)


def test_the_console_socket_refuses_to_resume_after_another_orgs_event(org_a, org_b):
    cookie = session_cookie("alice", org_a)

    async def scenario():
        theirs = await emit(org_b, "job.completed", {})
        socket = communicator(cookie)
        socket.scope["query_string"] = f"after={theirs.id}".encode()
        assert await socket.connect() == (False, 4400)
        await socket.disconnect()

    run(scenario)


def test_an_orgs_events_commit_in_sequence_order(org_a, org_b):
    """A second emit for the org waits for the first one's transaction to commit, so a reader
    never sees event N+1 while event N can still appear; another org's emit does not wait."""
    from django.db import transaction

    first_written, release_first = threading.Event(), threading.Event()
    done: dict[str, Event] = {}

    def in_thread(name, work):
        def target():
            try:
                done[name] = work()
            finally:
                connection.close()

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    def first():
        with transaction.atomic():
            event = Event.objects.emit(org_a, "job.running", {})
            first_written.set()
            release_first.wait(5)
        return event

    holder = in_thread("first", first)
    assert first_written.wait(5)
    second = in_thread("second", lambda: Event.objects.emit(org_a, "job.running", {}))
    other = in_thread("other", lambda: Event.objects.emit(org_b, "job.running", {}))
    other.join(5)
    assert "other" in done
    wait_for(
        lambda: lock_waits("advisory", classid=EMIT_LOCK_NAMESPACE, objid=org_a.pk) == 1,
        "the second emit to wait for the org's event lock",
    )
    assert "second" not in done  # still waiting for the first transaction
    release_first.set()
    for thread in (holder, second):
        thread.join(5)
    assert done["first"].sequence < done["second"].sequence


def test_one_transaction_announces_its_events_once_per_org(org_a, org_b):
    """A group commit's events (several jobs, two orgs) cost one push per org, which names
    their types and the highest sequence; a stream filtered to other types ignores it."""
    emit_all = database_sync_to_async(Event.objects.emit_all)

    async def scenario():
        layer = get_channel_layer()
        channels = {}
        for org in (org_a, org_b):
            channels[org.pk] = await layer.new_channel()
            await layer.group_add(org_group(org.pk), channels[org.pk])
        rows = await emit_all(
            [
                (org_a, "job.queued", {}),
                (org_b, "job.queued", {}),
                (org_a, "job.queued", {}),
                (org_a, "job.running", {}),
            ]
        )
        for org, types in ((org_a, ["job.queued", "job.running"]), (org_b, ["job.queued"])):
            push = await asyncio.wait_for(layer.receive(channels[org.pk]), 5)
            assert push["types"] == types
            assert push["sequence"] == max(r.sequence for r in rows if r.org_id == org.pk)
            with pytest.raises(TimeoutError):  # and only one
                await asyncio.wait_for(layer.receive(channels[org.pk]), 0.3)
            cursor = stream.EventCursor(org.pk, 0, frozenset({"job.completed"}))
            assert not cursor.is_news(push)
            assert stream.EventCursor(org.pk, 0, frozenset({"job.queued"})).is_news(push)

    run(scenario)
