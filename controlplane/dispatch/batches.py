"""Creating a batch: one admitted Job per valid line of its input file, dispatched in prompt
order (the life of a batch after that is controlplane/jobs/batches.py)."""

from __future__ import annotations

import contextlib
import itertools
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.api.errors import ApiError
from controlplane.catalog.registry import live_nodes
from controlplane.dispatch.admission import submit_prepared
from controlplane.dispatch.disaggregation import split
from controlplane.dispatch.enqueue import enqueue_job
from controlplane.dispatch.preparing import prepare_request
from controlplane.dispatch.routing import choose_route
from controlplane.jobs.batches import Batch, new_batch_id
from controlplane.jobs.files import BATCH_URLS, File, parse_batch_lines
from controlplane.jobs.models import Job

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512


class BatchRejected(Exception):
    """A batch that cannot be created; `param` names the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def common_prefix_len(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def wants_one_node(sorted_prompts: list[list[int]]) -> bool:
    """Whether a batch's prompts for one model (sorted) share prefixes enough to send them all
    to one node.

    The prefix cache is per node: lines that share a system prompt or a long document only hit
    it when they run where that prefix was computed. On the shared queue every node with room
    pulls lines, and each recomputes the prefix; on one node's queue the prefix is computed
    once. Only full KV blocks are cached, so a shared prefix shorter than one block
    (`BATCH_AFFINITY_PREFIX_TOKENS`, the engine's 16) gains nothing, and a small batch is not
    worth giving up the other nodes for. Half of the neighbouring pairs sharing a block is
    "many"."""
    if len(sorted_prompts) < settings.BATCH_AFFINITY_MIN_LINES:
        return False
    shared = sum(
        common_prefix_len(a, b) >= settings.BATCH_AFFINITY_PREFIX_TOKENS
        for a, b in itertools.pairwise(sorted_prompts)
    )
    return 2 * shared >= len(sorted_prompts) - 1


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > METADATA_MAX_PAIRS
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= METADATA_MAX_KEY
            and len(v) <= METADATA_MAX_VALUE
            for k, v in metadata.items()
        )
    ):
        raise BatchRejected(
            f"'metadata' must be an object of at most {METADATA_MAX_PAIRS} string pairs (keys up "
            f"to {METADATA_MAX_KEY} characters, values up to {METADATA_MAX_VALUE}).",
            "metadata",
        )
    return metadata


def create_batch(
    principal,
    input_file: File,
    endpoint: Any,
    completion_window: Any,
    metadata: Any = None,
) -> Batch:
    """Create a batch from an uploaded input file and queue one job per valid line.

    Each line's body goes through the completion endpoints' own admission step (validation,
    tokenization, context check); a line that fails it becomes no job and goes to the error
    file with its error. BatchRejected for a bad request as a whole.

    Dispatch order: the jobs are enqueued sorted by their prompt token ids, so lines that
    share a prefix (a system prompt, a document asked several questions) reach the nodes
    back to back and the second finds the first's KV blocks still in the prefix cache, not
    evicted by unrelated prompts in between. When most lines share a prefix
    (`wants_one_node`), they all go to one node through the routing's session affinity
    (`batch:<id>`), since a prefix cached on one node does not help another."""
    if endpoint not in BATCH_URLS:
        raise BatchRejected(f"'endpoint' must be one of {sorted(BATCH_URLS)}.", "endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchRejected(
            f"'completion_window' must be one of {sorted(COMPLETION_WINDOWS)}.",
            "completion_window",
        )
    metadata = _check_metadata(metadata)
    if input_file.purpose != File.BATCH:
        raise BatchRejected(
            f"The file '{input_file.id}' was not uploaded with purpose 'batch'.",
            "input_file_id",
        )
    lines = parse_batch_lines(bytes(input_file.content))
    for line in lines:
        if line.url != endpoint:
            raise BatchRejected(
                f"Line {line.line} of the input file asks for {line.url}, not the batch's "
                f"endpoint {endpoint}.",
                "endpoint",
            )
    job_endpoint = BATCH_URLS[endpoint]
    prepared, invalid = [], []
    for line in lines:
        try:
            if line.body.get("stream") is True:
                raise ApiError(400, "Batch requests cannot stream.", "stream", "invalid_value")
            prepared.append((line, prepare_request(line.body, job_endpoint)))
        except ApiError as error:
            invalid.append(
                {
                    "line": line.line,
                    "custom_id": line.custom_id,
                    "code": error.code or "invalid_request",
                    "message": error.message,
                    "param": error.param,
                }
            )
    # Shared prefixes back to back; lines of one model together.
    prepared.sort(key=lambda item: (item[1].model.id, item[1].prompt_token_ids))
    now = timezone.now()
    expires_at = now + COMPLETION_WINDOWS[completion_window]
    deadline = expires_at.timestamp()
    batch_id = new_batch_id()
    affinity = {}
    for model_id in {p.model.id for _, p in prepared}:
        prompts = [p.prompt_token_ids for _, p in prepared if p.model.id == model_id]
        affinity[model_id] = f"batch:{batch_id}" if wants_one_node(prompts) else ""
    with transaction.atomic():
        batch = Batch.objects.create(
            id=batch_id,
            org=principal.org,
            api_key=principal.api_key,
            endpoint=endpoint,
            model=prepared[0][1].model.id if prepared else "",
            input_file_id=input_file.id,
            completion_window=completion_window,
            metadata=metadata,
            status=Batch.IN_PROGRESS,
            total=len(lines),
            failed=len(invalid),
            invalid_lines=invalid,
            in_progress_at=now,
            expires_at=expires_at,
        )
        jobs = [
            submit_prepared(
                request,
                principal,
                job_endpoint,
                mode=Job.BATCH,
                deadline=deadline,
                session_affinity=affinity[request.model.id],
                batch=batch,
                custom_id=line.custom_id,
            )
            for line, request in prepared
        ]
        batch.emit("batch.in_progress")
    for job in jobs:
        nodes = live_nodes(job.model)
        route = choose_route(job.model, nodes, job.session_affinity or None)
        route = split(job.model, nodes, route, job.prompt_token_ids, principal.org.slug)
        # A refused enqueue fails its job (counted failed); the batch goes on with the others.
        with contextlib.suppress(ApiError):
            enqueue_job(job, route, None, deadline)
    Batch.objects.finalize_if_done(batch.id)  # a batch without a valid line ends here
    batch.refresh_from_db()
    return batch
