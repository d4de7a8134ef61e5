"""The remaining chat parameters through the official `openai` package on the production stack:
logprobs and top_logprobs (chat and legacy completions, plain and streamed), logit_bias,
max_completion_tokens, seed, stop and user."""

from __future__ import annotations

import math

import openai
import pytest

from controlplane.billing.models import UsageRecord
from tests.controlplane.openai_spec import validate
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ASK = [{"role": "user", "content": "Say something."}]


def test_chat_parameters_through_the_sdk(stack, tiny_model, acme_key):
    model = tiny_model.id
    stack.start_node(model, "node-a")
    stack.wait_ready(model, nodes=1, api_key=acme_key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    try:
        answer = client.chat.completions.create(
            model=model, messages=ASK, max_completion_tokens=6, temperature=0,
            logprobs=True, top_logprobs=3, user="agent-7",
        )  # fmt: skip
        validate(answer.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
        entries = answer.choices[0].logprobs.content
        assert len(entries) == answer.usage.completion_tokens == 6
        for entry in entries:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            # Greedy: the chosen token is the most likely one.
            assert math.isclose(entry.logprob, tops[0], abs_tol=1e-5)
            assert entry.token == entry.top_logprobs[0].token
        assert "".join(e.token for e in entries) == answer.choices[0].message.content

        # Streamed, the same tokens and log-probabilities arrive with the deltas.
        stream = client.chat.completions.create(
            model=model, messages=ASK, max_completion_tokens=6, temperature=0, stream=True,
            logprobs=True, top_logprobs=3,
        )  # fmt: skip
        streamed = [
            entry
            for chunk in stream
            if chunk.choices and chunk.choices[0].logprobs
            for entry in chunk.choices[0].logprobs.content
        ]
        assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
            (e.token, round(e.logprob, 5)) for e in entries
        ]

        # Legacy completions: `logprobs: 2` gives tokens, their log-probabilities, offsets.
        text = client.completions.create(
            model=model, prompt="Once upon", max_tokens=5, temperature=0, logprobs=2
        )
        validate(text.model_dump(exclude_unset=True), "CreateCompletionResponse")
        legacy = text.choices[0].logprobs
        assert len(legacy.tokens) == len(legacy.token_logprobs) == 5
        assert all(len(top) <= 2 for top in legacy.top_logprobs)
        assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(5)]

        # logit_bias: +100 on one token makes greedy decoding pick only it.
        token_id = 42
        forced = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4, temperature=0,
            logit_bias={str(token_id): 100}, logprobs=True,
        )  # fmt: skip
        tokens = {e.token for e in forced.choices[0].logprobs.content}
        assert len(tokens) == 1

        # seed: the same seed samples the same text.
        runs = [
            client.chat.completions.create(
                model=model, messages=ASK, max_tokens=8, temperature=1.0, seed=11
            )
            .choices[0]
            .message.content
            for _ in range(2)
        ]
        assert runs[0] == runs[1]

        # n: several completions of one prompt, the prompt billed once.
        several = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=5, temperature=1.0, seed=3, n=3,
            logprobs=True,
        )  # fmt: skip
        validate(several.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
        assert [c.index for c in several.choices] == [0, 1, 2]
        assert len({c.message.content for c in several.choices}) > 1  # seeds 3, 4, 5
        assert several.usage.completion_tokens == sum(
            len(c.logprobs.content) for c in several.choices
        )
        records = UsageRecord.objects.filter(request_id=several.id.replace("chatcmpl-", "req_"))
        record = wait_for(records.first, what="the usage row")
        assert record.prompt_tokens == several.usage.prompt_tokens
        assert record.completion_tokens == several.usage.completion_tokens

        # Streamed with n = 2: each choice's deltas carry its index, and each choice finishes.
        stream = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=5, temperature=0, n=2, stream=True
        )
        texts, reasons = {0: "", 1: ""}, {}
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert set(reasons) == {0, 1} and texts[0] == texts[1]  # greedy: the same twice

        # Legacy completions with n = 2.
        legacy_n = client.completions.create(model=model, prompt="Once", max_tokens=3, n=2)
        assert [c.index for c in legacy_n.choices] == [0, 1]

        # A bad top_logprobs is a 400 naming it.
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=ASK, top_logprobs=3)
        assert refused.value.body["param"] == "top_logprobs"
    except Exception:
        print(stack.outputs())
        raise
