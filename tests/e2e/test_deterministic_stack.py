"""Deterministic mode through the API on the production stack (uvicorn, a `runnode
--deterministic` process, the worker, PostgreSQL, Redis), driven by the official `openai`
package: the same greedy and seeded requests give the same content, logprobs and
`system_fingerprint` alone, among 64 concurrent others, streamed, as an async job and as a batch
line."""

from __future__ import annotations

import io
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.controlplane.conftest import priced_model
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SYSTEM = "You review pull requests and answer in one short paragraph. " * 6


def _requests(model: str) -> dict[str, dict]:
    base = {
        "model": model,
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 2,
    }
    return {
        "greedy": {
            **base,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Is this change safe: retry on 503?"},
            ],
            "temperature": 0,
        },
        "seeded": {
            **base,
            "messages": [{"role": "user", "content": "Name three uses of a prefix cache."}],
            "temperature": 0.9,
            "seed": 7,
        },
    }


def _answer(body: dict) -> tuple:
    """(content, [(token, logprob, top alternatives)], system_fingerprint) of a response body."""
    choice = body["choices"][0]
    entries = choice["logprobs"]["content"]
    return (
        choice["message"]["content"],
        [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in entries
        ],
        body.get("system_fingerprint"),
    )


def _others(model: str, count: int) -> list[dict]:
    rng = random.Random(64)
    words = [
        "cache",
        "block",
        "token",
        "queue",
        "node",
        "batch",
        "prefix",
        "decode",
        "agent",
        "review",
    ]
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM}
                if i % 2
                else {"role": "system", "content": "Be brief."},
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randrange(3, 120)))},
            ],
            "max_tokens": rng.randrange(4, 24),
            "temperature": rng.choice([0, 0.7]),
        }
        for i in range(count)
    ]


def test_the_same_request_gets_the_same_answer_however_it_is_sent(stack, tiny_llama_dir, acme_key):
    import openai

    model = priced_model(f"tiny-det-{os.getpid()}", str(tiny_llama_dir), 1024)
    # dtype "auto": bfloat16 where the CPU has native bf16, float32 elsewhere.
    stack.start_node(model.id, "node-det", "--deterministic")
    stack.wait_ready(model.id, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    requests = _requests(model.id)

    def sync(body: dict) -> dict:
        return client.chat.completions.create(**body).model_dump()

    try:
        alone = {name: _answer(sync(body)) for name, body in requests.items()}
        fingerprint = alone["greedy"][2]
        assert fingerprint and fingerprint.startswith("fp_")
        assert alone["seeded"][2] == fingerprint

        # Among 64 concurrent others, submitted in between them.
        others = _others(model.id, 64)
        mixed = others[:32] + list(requests.values()) + others[32:]
        with ThreadPoolExecutor(max_workers=66) as pool:
            answers = list(pool.map(sync, mixed))
        assert _answer(answers[32]) == alone["greedy"]
        assert _answer(answers[33]) == alone["seeded"]

        # Streamed: the same text, every chunk with the same fingerprint.
        chunks = list(client.chat.completions.create(**requests["greedy"], stream=True))
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == (alone["greedy"][0])
        )
        assert {c.system_fingerprint for c in chunks} == {fingerprint}

        # As an async job.
        for name, body in requests.items():
            job = client.chat.completions.with_raw_response.create(
                **body, extra_body={"queue": True}
            ).http_response.json()
            wait_for(
                lambda job_id=job["id"]: (
                    client.get(f"/jobs/{job_id}", cast_to=object)["status"] == "completed"
                ),
                what="the job completed",
            )
            done = client.get(f"/jobs/{job['id']}", cast_to=object)
            assert _answer(done["response"]) == alone[name], name

        # As batch lines.
        lines = [
            {"custom_id": name, "method": "POST", "url": "/v1/chat/completions", "body": body}
            for name, body in requests.items()
        ]
        content = "\n".join(json.dumps(line) for line in lines).encode()
        uploaded = client.files.create(file=("det.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(
            lambda: client.batches.retrieve(batch.id).status == "completed",
            what="the batch completed",
        )
        output_file = client.batches.retrieve(batch.id).output_file_id
        output = client.files.content(output_file).text.splitlines()
        assert len(output) == len(lines)
        for line in map(json.loads, output):
            assert _answer(line["response"]["body"]) == alone[line["custom_id"]]
    except Exception:
        print(stack.outputs())
        raise
