"""`manage.py serve --disaggregated`: a prefill node and a decode node in the one embedded process,
KV over the Transfer Engine on loopback, driven by the official `openai` SDK. A long prompt is
split (the headers name both nodes, streamed or not) and gives unified mode's tokens; its next
turn, whose prefix the decode node now holds, is not."""

from __future__ import annotations

import openai
import pytest

from inference.engine import LLM, SamplingParams
from inference.engine.tokenizer import Tokenizer
from tests.e2e.stack import EmbeddedServer

QUESTION = " ".join(f"word{i % 9} alpha beta" for i in range(13))


@pytest.fixture
def split_server(tmp_path, tiny_llama_dir):
    server = EmbeddedServer(tmp_path, "tiny", tiny_llama_dir, "--disaggregated")
    server.env["HEARTH_DISAGG_MIN_TOKENS"] = "96"
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_embedded_mode_splits_a_long_prompt_and_names_both_nodes(split_server, tiny_llama_dir):
    client = openai.OpenAI(base_url=f"{split_server.url}/v1", api_key=split_server.api_key)
    messages = [{"role": "user", "content": QUESTION}]
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=16, temperature=0
        )
        completion = raw.parse()
        assert raw.headers["x-hearth-node"] == "embedded-tiny-decode"
        assert raw.headers["x-hearth-prefill-node"] == "embedded-tiny-prefill"
        assert completion.usage.prompt_tokens_details.cached_tokens == 0

        prompt = Tokenizer(tiny_llama_dir).apply_chat_template(messages)
        assert completion.usage.prompt_tokens == len(prompt) > 100
        [unified] = LLM(str(tiny_llama_dir), dtype="float32").generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=16)
        )
        assert completion.choices[0].message.content == unified.text

        # Streamed, with a new question after the same history: the decode node holds the
        # history, so only the new part is uncached: not split, and counted as cached.
        turn = [*messages, {"role": "assistant", "content": unified.text}]
        turn.append({"role": "user", "content": "and then?"})
        with client.chat.completions.with_streaming_response.create(
            model="tiny",
            messages=turn,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ) as stream:
            assert stream.headers["x-hearth-node"] == "embedded-tiny-decode"
            assert "x-hearth-prefill-node" not in stream.headers
            chunks = list(stream.parse())
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 96

        # A second long question is split again, streamed: both nodes named on the stream.
        other = [{"role": "user", "content": QUESTION.replace("alpha", "gamma")}]
        with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=other, max_tokens=8, temperature=0, stream=True
        ) as stream:
            assert stream.headers["x-hearth-prefill-node"] == "embedded-tiny-prefill"
            list(stream.parse())
    except Exception:
        print(split_server.output())
        raise
