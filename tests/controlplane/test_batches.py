"""OpenAI's Files and Batch API: uploads checked line by line, one job per valid line dispatched
in prompt order, progress counted as jobs settle, output and error files written exactly once,
cancel and expiry with partial results, and another org's files and batches a 404.

No node runs here: jobs settle through `Job.objects.record_started`/`record_completion` with
node-shaped payloads, the path a node's messages take. Views run on `live_server` threads,
hence committed fixtures (transaction=True).
"""

from __future__ import annotations

import io
import json
import threading
from contextlib import contextmanager
from datetime import timedelta

import dramatiq
import openai
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection, connections
from django.utils import timezone

from controlplane.catalog.registry import use_memory_heartbeat
from controlplane.dispatch.batches import wants_one_node
from controlplane.events.models import Event
from controlplane.jobs.batches import Batch
from controlplane.jobs.files import File
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from inference.protocol.heartbeat import MemoryHeartbeat
from inference.protocol.messages import CompletionResult, Usage, model_queue, node_queue
from tests.controlplane.conftest import priced_model
from tests.controlplane.openai_spec import validate

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "tiny-batch"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def drain(queue: str) -> list[dict]:
    """The generation messages waiting on `queue`, oldest first (and the queue emptied)."""
    broker = dramatiq.get_broker()
    broker.declare_queue(queue)
    consumer = broker.consume(queue, timeout=200)
    found = []
    while (message := next(consumer)) is not None:
        found.append(message.args[0])
        consumer.ack(message)
    consumer.close()
    return found


@pytest.fixture
def tiny(tiny_llama_dir):
    model = priced_model(MODEL, str(tiny_llama_dir), 64)
    drain(model_queue(MODEL))  # messages an earlier test left
    yield model
    drain(model_queue(MODEL))


@pytest.fixture
def sdk(live_server, key_a):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key_a, max_retries=0)


@pytest.fixture
def sdk_b(live_server, key_b):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key_b, max_retries=0)


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], **body},
    }


def text_line(custom_id: str, prompt, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": TEXT,
        "body": {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body},
    }


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(client, key: str, content: bytes, purpose: str = "batch"):
    data = {"purpose": purpose, "file": SimpleUploadedFile("in.jsonl", content)}
    return client.post("/v1/files", data, HTTP_AUTHORIZATION=f"Bearer {key}")


def result_for(job: Job, cached: int = 0, finish_reason: str = "stop") -> CompletionResult:
    return CompletionResult(
        request_id=job.request_id,
        job_id=job.id,
        node="node-1",
        text=f"answer to {job.custom_id}",
        token_ids=[1, 2, 3],
        finish_reason=finish_reason,
        usage=Usage(len(job.prompt_token_ids), cached, 3),
    )


def settle(job: Job, cached: int = 0) -> None:
    Job.objects.record_started({"request_id": job.request_id, "node": "node-1"})
    record_completion(result_for(job, cached))


def create_batch(sdk, lines: list, endpoint: str = CHAT):
    uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def read_jsonl(sdk, file_id: str) -> list[dict]:
    return [json.loads(line) for line in sdk.files.content(file_id).content.splitlines()]


def batch_body(sdk, batch_id: str) -> dict:
    """The raw Batch object, as the spec validates it."""
    raw = sdk.batches.with_raw_response.retrieve(batch_id)
    return json.loads(raw.content)


def test_the_sdk_uploads_retrieves_and_downloads_a_file(sdk, tiny):
    content = jsonl([chat_line("a", "hello"), chat_line("b", "bye")])
    uploaded = sdk.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(content)
    assert uploaded.filename == "requests.jsonl" and uploaded.purpose == "batch"
    raw = sdk.files.with_raw_response.retrieve(uploaded.id)
    validate(json.loads(raw.content), "OpenAIFile")
    assert sdk.files.retrieve(uploaded.id).id == uploaded.id
    assert sdk.files.content(uploaded.id).content == content
    assert [f.id for f in sdk.files.list()] == [uploaded.id]
    assert sdk.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)


@pytest.mark.parametrize(
    ("second_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"method": "POST", "url": CHAT, "body": {}}, "'custom_id'"),
        (chat_line("a", "again"), "appears more than once"),
        ({**chat_line("b", "x"), "url": "/v1/embeddings"}, "'url'"),
        ({**chat_line("b", "x"), "body": "hello"}, "'body'"),
        ({**chat_line("b", "x"), "method": "GET"}, "'method'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_it_names_the_bad_line_of_an_input_file(client, key_a, second_line, message):
    response = upload(client, key_a, jsonl([chat_line("a", "hi"), second_line]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "file" and error["message"].startswith("Line 2: ")
    assert message in error["message"]
    validate(response.json(), "ErrorResponse")
    assert not File.objects.exists()


def test_it_refuses_a_file_over_the_size_limit(client, key_a, settings):
    settings.FILES_MAX_BYTES = 100
    response = upload(client, key_a, jsonl([chat_line("a", "x" * 200)]))
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert "at most 100 bytes" in response.json()["error"]["message"]


def test_it_refuses_more_lines_than_the_limit_and_other_purposes(client, key_a, settings):
    settings.BATCH_MAX_LINES = 2
    response = upload(client, key_a, jsonl([chat_line(str(i), "x") for i in range(3)]))
    assert response.status_code == 400 and "Line 3: " in response.json()["error"]["message"]
    response = upload(client, key_a, jsonl([chat_line("a", "x")]), purpose="fine-tune")
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"


def test_a_batch_queues_one_job_per_valid_line_and_counts_invalid_ones_failed(sdk, tiny):
    lines = [
        chat_line("a", "hello"),
        chat_line("b", "hi", temperature="hot"),
        chat_line("c", "hey"),
        chat_line("d", "x", stream=True),
    ]
    batch = create_batch(sdk, lines)
    assert batch.id.startswith("batch_") and batch.status == "in_progress"
    assert batch.endpoint == CHAT and batch.completion_window == "24h"
    assert batch.request_counts.total == 4 and batch.request_counts.failed == 2
    assert batch.expires_at - batch.created_at == 24 * 3600
    validate(batch_body(sdk, batch.id), "Batch")
    jobs = Job.objects.filter(batch_id=batch.id)
    assert sorted(job.custom_id for job in jobs) == ["a", "c"]
    assert all(job.mode == Job.BATCH and job.status == Job.QUEUED for job in jobs)
    assert all(int(job.deadline_at.timestamp()) == batch.expires_at for job in jobs)
    assert len(drain(model_queue(MODEL))) == 2
    assert Event.objects.filter(type="batch.in_progress", data__id=batch.id).count() == 1


def test_a_settled_batch_completes_with_output_and_error_files(sdk, tiny):
    lines = [chat_line("a", "hello"), chat_line("bad", "x", top_p=7), chat_line("c", "hey")]
    batch = create_batch(sdk, lines)
    for job in Job.objects.filter(batch_id=batch.id).select_related("org"):
        settle(job, cached=2)
        assert sdk.batches.retrieve(batch.id).status in ("in_progress", "completed")
    done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at and done.finalizing_at
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    validate(batch_body(sdk, batch.id), "Batch")
    output = read_jsonl(sdk, done.output_file_id)
    assert [entry["custom_id"] for entry in output] == ["a", "c"]  # input order
    for entry in output:
        assert entry["id"].startswith("batch_req_") and entry["error"] is None
        assert entry["response"]["status_code"] == 200
        body = entry["response"]["body"]
        validate(body, "CreateChatCompletionResponse")
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        assert body["choices"][0]["message"]["content"] == f"answer to {entry['custom_id']}"
        job = Job.objects.get(request_id=entry["response"]["request_id"])
        assert job.custom_id == entry["custom_id"]
    [error] = read_jsonl(sdk, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"] is None
    assert error["error"]["code"] == "invalid_value" and "top_p" in error["error"]["message"]
    assert done.usage.input_tokens_details.cached_tokens == 4 and done.usage.output_tokens == 6
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"
    types = list(
        Event.objects.filter(data__id=batch.id).order_by("sequence").values_list("type", flat=True)
    )
    assert types == ["batch.in_progress", "batch.completed"]


def test_a_batch_without_a_valid_line_fails_with_its_errors(sdk, tiny):
    batch = create_batch(sdk, [chat_line("a", "x", temperature=9), chat_line("b", "y", n=9)])
    assert batch.status == "failed" and batch.failed_at
    assert batch.request_counts.failed == 2 and batch.output_file_id is None
    assert [e.line for e in batch.errors.data] == [1, 2]
    assert [e["custom_id"] for e in read_jsonl(sdk, batch.error_file_id)] == ["a", "b"]
    validate(batch_body(sdk, batch.id), "Batch")


def test_cancel_midway_ends_cancelled_with_partial_output(sdk, tiny):
    batch = create_batch(sdk, [chat_line(c, f"hello {c}") for c in "abcd"])
    jobs = {job.custom_id: job for job in Job.objects.filter(batch_id=batch.id)}
    settle(jobs["a"])
    Job.objects.record_started({"request_id": jobs["b"].request_id, "node": "node-1"})
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    statuses = {job.custom_id: job.status for job in Job.objects.filter(batch_id=batch.id)}
    assert statuses == {"a": "completed", "b": "running", "c": "cancelled", "d": "cancelled"}
    # The node stops b and reports what it generated; that settles the batch.
    record_completion(result_for(jobs["b"], finish_reason="abort"))
    cancelled = sdk.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    assert (cancelled.request_counts.completed, cancelled.request_counts.failed) == (1, 3)
    assert [e["custom_id"] for e in read_jsonl(sdk, cancelled.output_file_id)] == ["a"]
    errors = read_jsonl(sdk, cancelled.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("b", "batch_cancelled"),
        ("c", "batch_cancelled"),
        ("d", "batch_cancelled"),
    ]
    validate(batch_body(sdk, batch.id), "Batch")
    assert sdk.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def test_an_overdue_batch_expires_with_partial_output(sdk, tiny):
    batch = create_batch(sdk, [chat_line(c, f"hello {c}") for c in "abc"])
    settle(Job.objects.select_related("org").get(batch_id=batch.id, custom_id="b"))
    past = timezone.now() - timedelta(seconds=1)
    Batch.objects.filter(id=batch.id).update(expires_at=past)
    Job.objects.filter(batch_id=batch.id).update(deadline_at=past)
    expired = sdk.batches.retrieve(batch.id)  # reads expire the org's overdue jobs first
    assert expired.status == "expired" and expired.expired_at
    assert (expired.request_counts.completed, expired.request_counts.failed) == (1, 2)
    assert [e["custom_id"] for e in read_jsonl(sdk, expired.output_file_id)] == ["b"]
    errors = read_jsonl(sdk, expired.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert Event.objects.filter(type="batch.expired", data__id=batch.id).count() == 1


def test_another_orgs_batch_and_file_are_not_found(sdk, sdk_b, tiny):
    batch = create_batch(sdk, [chat_line("a", "hello")])
    with pytest.raises(openai.NotFoundError):
        sdk_b.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.files.retrieve(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.files.content(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        sdk_b.batches.create(
            input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
        )
    assert list(sdk_b.batches.list()) == [] and list(sdk_b.files.list()) == []
    assert Batch.objects.get(id=batch.id).status == "in_progress"


def test_it_refuses_a_batch_whose_lines_name_another_endpoint(sdk, tiny):
    uploaded = sdk.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "hi"), text_line("b", "hi")]))),
        purpose="batch",
    )
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert refused.value.param == "endpoint" and "Line 2" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="1h")
    assert refused.value.param == "completion_window"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint=CHAT,
            completion_window="24h",
            metadata={"run": 7},
        )
    assert refused.value.param == "metadata"
    assert not Batch.objects.exists() and not Job.objects.exists()
    good = sdk.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "hi")]))), purpose="batch"
    )
    batch = sdk.batches.create(
        input_file_id=good.id, endpoint=CHAT, completion_window="24h", metadata={"run": "7"}
    )
    assert sdk.batches.retrieve(batch.id).metadata == {"run": "7"}


def test_it_lists_batches_newest_first_in_pages(sdk, tiny):
    ids = [create_batch(sdk, [chat_line("a", "hi")]).id for _ in range(3)]
    first = sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
    second = sdk.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == [ids[0]] and not second.has_more
    assert [b.id for b in sdk.batches.list(limit=2)] == ids[::-1]  # the SDK follows the pages
    raw = sdk.batches.with_raw_response.list()
    validate(json.loads(raw.content), "ListBatchesResponse")


def test_finalization_happens_once_when_the_last_settlements_race(sdk, tiny):
    batch = create_batch(sdk, [chat_line(c, f"hello {c}") for c in "abcd"])
    jobs = list(Job.objects.filter(batch_id=batch.id).select_related("org"))
    for job in jobs[:2]:
        settle(job)
    for job in jobs[2:]:
        Job.objects.record_started({"request_id": job.request_id, "node": "node-1"})
    barrier = threading.Barrier(2)
    errors = []

    def finish(job: Job) -> None:
        try:
            barrier.wait()
            record_completion(result_for(job))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=finish, args=(job,)) for job in jobs[2:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    final = Batch.objects.get(id=batch.id)
    assert final.status == "completed" and (final.completed, final.failed) == (4, 0)
    assert Event.objects.filter(type="batch.completed", data__id=batch.id).count() == 1
    assert File.objects.filter(purpose="batch_output").count() == 1
    assert len(read_jsonl(sdk, final.output_file_id)) == 4


def test_jobs_are_dispatched_in_prompt_order(sdk, tiny):
    prompts = {"c": [9, 8, 7], "a": [2, 3, 4], "d": [5, 6, 1], "b": [5, 6, 0], "e": [2, 3]}
    batch = create_batch(sdk, [text_line(c, p) for c, p in prompts.items()], endpoint=TEXT)
    sent = drain(model_queue(MODEL))
    jobs = {job.request_id: job for job in Job.objects.filter(batch_id=batch.id)}
    assert [jobs[m["request_id"]].custom_id for m in sent] == ["e", "a", "b", "d", "c"]
    assert [m["prompt_token_ids"] for m in sent] == sorted(prompts.values())
    assert all(m["reply_channel"] is None for m in sent)
    assert {m["deadline"] for m in sent} == {Batch.objects.get(id=batch.id).expires_at.timestamp()}


@pytest.fixture
def two_nodes():
    """Two live nodes of MODEL, as their heartbeats would report them."""
    heartbeat = MemoryHeartbeat()
    for node in ("node-1", "node-2"):
        heartbeat(node, {"id": node, "model": MODEL, "free_slots": 4}, ttl_s=60)
    use_memory_heartbeat(heartbeat)
    yield
    use_memory_heartbeat(None)
    for node in ("node-1", "node-2"):
        drain(node_queue(MODEL, node))


def test_a_batch_that_shares_a_prefix_goes_to_one_node_in_order(sdk, tiny, two_nodes):
    shared = list(range(10, 30))  # 20 tokens: more than one 16-token KV block
    lines = [text_line(str(i), [*shared, 45 - i]) for i in range(4)]
    batch = create_batch(sdk, lines, endpoint=TEXT)
    affinities = set(Job.objects.filter(batch_id=batch.id).values_list("session_affinity"))
    assert affinities == {(f"batch:{batch.id}",)}
    per_node = {node: drain(node_queue(MODEL, node)) for node in ("node-1", "node-2")}
    [sent] = [sent for sent in per_node.values() if sent]  # all on one node
    assert [m["prompt_token_ids"][-1] for m in sent] == [42, 43, 44, 45]
    assert drain(model_queue(MODEL)) == []
    # Prompts without a shared block go to the shared queue, any node with room.
    distinct = create_batch(sdk, [text_line(str(i), [i + 1, 50, 51]) for i in range(4)], TEXT)
    assert set(
        Job.objects.filter(batch_id=distinct.id).values_list("session_affinity", flat=True)
    ) == {""}
    assert len(drain(model_queue(MODEL))) == 4


def test_one_node_is_chosen_only_for_many_lines_sharing_a_block(settings):
    settings.BATCH_AFFINITY_PREFIX_TOKENS, settings.BATCH_AFFINITY_MIN_LINES = 4, 3
    assert wants_one_node([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7]])
    assert not wants_one_node([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]])  # too few lines
    assert not wants_one_node([[1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7]])  # under a block
    # Two groups of three: four of five neighbouring pairs share a block.
    groups = [[1, 1, 1, 1, i] for i in range(3)] + [[2, 2, 2, 2, i] for i in range(3)]
    assert wants_one_node(groups)


@contextmanager
def disk_full_for_batch_output():
    """PostgreSQL, which stores the files, refuses to write a batch's output file as on a full
    disk (SQLSTATE 53100, disk_full) until the block ends."""
    table = File._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION refuse_as_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'could not extend file: No space left on device' "
            "USING ERRCODE = 'disk_full'; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER disk_full BEFORE INSERT ON {table} FOR EACH ROW "
            f"WHEN (NEW.purpose = '{File.BATCH_OUTPUT}') EXECUTE FUNCTION refuse_as_disk_full()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER disk_full ON {table}")
            cursor.execute("DROP FUNCTION refuse_as_disk_full()")


def test_a_finalization_that_failed_is_done_by_the_next_read(sdk, tiny):
    batch = create_batch(sdk, [chat_line("a", "hello")])
    with disk_full_for_batch_output():
        settle(Job.objects.select_related("org").get(batch_id=batch.id))  # the job still settles
        stuck = Batch.objects.get(id=batch.id)
        assert stuck.status == "in_progress" and stuck.completed == 1 and not stuck.output_file_id
        assert not File.objects.filter(purpose=File.BATCH_OUTPUT).exists()
    done = sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and len(read_jsonl(sdk, done.output_file_id)) == 1
    assert Event.objects.filter(type="batch.completed", data__id=batch.id).count() == 1
