"""The messages a node exchanges with the control plane (docs/architecture.md), as plain dicts.

Generation requests arrive as Dramatiq messages for the actor `generate` on the model's queue
`infer.<model>` or a node's own `infer.<model>.<node>`; their single argument is a dict:
`request_id`, `job_id`, `org` (the prefix-cache namespace), `prompt_token_ids`, `sampling`
(SamplingParams fields, plus `n`: how many completions), `reply_channel` (None for async
work), `deadline` (epoch seconds or None), `attempt`. Results leave as `record_completion`
messages on the control plane's queue, each result a `CompletionResult`: the results a node
finished within its report window travel together, as `{"node", "results": [result, …],
"answered"}` (one broker message and one settling transaction for all of them); a result
finished alone travels as the message itself (`results_of` reads both).

Each node also reads a control queue of its own, `infer.<model>.<node>.control`: `abort`
messages (`{"request_id"}`) stop a request it runs (a cancelled job, or one past its attempts),
and, on a decode node, `prefill_done` messages (inference/protocol/disagg.py) say its KV arrived.

A generation request the gateway chose to split (docs/disaggregation.md) also carries `prefill`:
`{"queue": …}`, the prefill queue (`prefill.<model>`, or a prefill node's own
`prefill.<model>.<node>`) the decode node sends its prefill message to. Its result then names the
prefill node that computed the prompt (`prefill_node`), and so does every delta of its stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inference.engine.outputs import Timings, TokenLogprob
from inference.engine.sampling_params import SamplingParams
from inference.errors import InvalidRequestError

GENERATE_ACTOR = "generate"
RECORD_COMPLETION_ACTOR = "record_completion"
RECORD_STARTED_ACTOR = "record_started"
ABORT_ACTOR = "abort"
PREFILL_ACTOR = "prefill"
PREFILL_DONE_ACTOR = "prefill_done"
CONTROLPLANE_QUEUE = "default"
MAX_N = 8  # the most completions one request may ask for
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def model_queue(model: str) -> str:
    """Queue every node serving `model` pulls from."""
    return f"infer.{model}"


def node_queue(model: str, node_id: str) -> str:
    """Queue only one node pulls from (session affinity)."""
    return f"infer.{model}.{node_id}"


def queue_node(model: str, queue: str) -> str | None:
    """The node whose own queue `queue` is (node_queue's inverse); None for the shared queue."""
    shared = model_queue(model)
    return queue[len(shared) + 1 :] if queue.startswith(shared + ".") else None


def prefill_queue(model: str) -> str:
    """Queue every prefill node serving `model` pulls prefill messages from."""
    return f"prefill.{model}"


def prefill_node_queue(model: str, node_id: str) -> str:
    """Queue only one prefill node pulls from (the gateway routed the prompt's prefix to it)."""
    return f"prefill.{model}.{node_id}"


def control_queue(model: str, node_id: str) -> str:
    """Queue of one node's control messages (aborts)."""
    return f"infer.{model}.{node_id}.control"


@dataclass
class GenerationRequest:
    """A generation request as a node receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    org: str = ""
    job_id: str | None = None
    reply_channel: str | None = None
    deadline: float | None = None
    attempt: int = 1
    n: int = 1  # how many completions of the prompt (OpenAI's `n`), each its own sequence
    # Split by the gateway: {"queue": the prefill queue to ask}; None runs the prompt here.
    prefill: dict[str, Any] | None = None

    @classmethod
    def from_message(cls, body: dict[str, Any]) -> GenerationRequest:
        """Parse a message argument; raises InvalidRequestError naming a bad field."""
        if not isinstance(body, dict):
            raise InvalidRequestError("a generation request must be a JSON object")
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id is required", param="request_id")
        tokens = body.get("prompt_token_ids")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
        sampling = dict(body.get("sampling") or {})
        n = sampling.pop("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}]", "n")
        unknown = set(sampling) - _SAMPLING_FIELDS
        if unknown:
            raise InvalidRequestError(f"unknown sampling fields {sorted(unknown)}", "sampling")
        try:
            params = SamplingParams(**sampling)
        except TypeError as exc:  # a field of the wrong type
            raise InvalidRequestError(f"invalid sampling parameters: {exc}", "sampling") from exc
        return cls(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=params,
            org=body.get("org") or "",
            job_id=body.get("job_id"),
            reply_channel=body.get("reply_channel"),
            deadline=body.get("deadline"),
            attempt=int(body.get("attempt") or 1),
            n=n,
            prefill=_prefill_route(body.get("prefill")),
        )


def _prefill_route(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("queue"), str):
        raise InvalidRequestError("prefill must be an object naming a queue", "prefill")
    return value


@dataclass
class Usage:
    """A result's token counts: the prompt, how much of it came from the prefix cache, and what
    was generated (over every choice)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class CompletionResult:
    """A node's result for one request: the argument of a `record_completion` message, or one
    of its `results`. Built by the node, read by the control plane's worker, both through this
    class, so neither side builds or reads the dict by hand. `error_code` "expired" marks a
    request refused because its deadline passed before it started; `logprobs`, when the request
    asked for them, holds one `logprob_entries` entry per generated token of the first choice;
    `choices`, only when n > 1, every choice as `{text, token_ids, finish_reason, logprobs}`."""

    request_id: str
    node: str = ""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = dataclasses.field(default_factory=Usage)
    job_id: str | None = None
    attempt: int = 1
    error: str | None = None
    error_code: str | None = None
    timings: dict[str, Any] = dataclasses.field(default_factory=dict)
    logprobs: list[dict[str, Any]] | None = None
    choices: list[dict[str, Any]] | None = None
    prefill_node: str | None = None  # the node that computed the prompt, when it was split
    system_fingerprint: str | None = None  # the engine's (inference/engine/fingerprint.py)

    @classmethod
    def from_message(cls, body: dict[str, Any]) -> CompletionResult:
        """Read one result as a node sent it; KeyError or TypeError for a malformed one."""
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {name: value for name, value in body.items() if name in fields}
        known["usage"] = Usage(**(body.get("usage") or {}))
        known["timings"] = body.get("timings") or {}
        return cls(**known)

    def as_message(self) -> dict[str, Any]:
        """The result as it travels in a `record_completion` message. Shallow: the node sends it
        at once, and `dataclasses.asdict` would copy every token list (once per result)."""
        return {**vars(self), "usage": vars(self.usage).copy()}


def completion_payload(
    request: GenerationRequest,
    node_id: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    prompt_tokens: int,
    cached_tokens: int,
    timings: Timings,
    error: str | None = None,
    error_code: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> CompletionResult:
    """The result of `request` on `node_id` (CompletionResult; its completion tokens are the
    first choice's until the node adds the others)."""
    return CompletionResult(
        request_id=request.request_id,
        job_id=request.job_id,
        attempt=request.attempt,
        node=node_id,
        text=text,
        token_ids=token_ids,
        finish_reason=finish_reason,
        error=error,
        error_code=error_code,
        usage=Usage(prompt_tokens, cached_tokens, len(token_ids)),
        timings=dataclasses.asdict(timings),
        logprobs=logprobs,
    )


def results_of(body: dict[str, Any]) -> list[CompletionResult]:
    """The results a `record_completion` message carries: its `results`, or the message itself
    when it is a single one (a node sends a result alone under its own message key)."""
    return [CompletionResult.from_message(result) for result in body.get("results", [body])]


def storable_text(text: str) -> str:
    """Generated text as the control plane can store it: NUL (U+0000), which PostgreSQL's jsonb
    refuses (a result holding one could never be recorded, so never billed), becomes U+FFFD.
    Deltas, results and logprob tokens all go through it, so a stream and its job agree."""
    return text.replace("\x00", "\ufffd")


def logprob_entries(tokenizer, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Tokens' log-probabilities in OpenAI's shape (`ChatCompletionTokenLogprob`): each token's
    text, its UTF-8 bytes, its log-probability and its most likely alternatives. A token that is
    part of a multi-byte character shows as U+FFFD, as its text alone decodes."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = storable_text(tokenizer.decode([token_id], skip_special_tokens=False))
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {
            **entry(item.token_id, item.logprob),
            "top_logprobs": [entry(token, value) for token, value in item.top_logprobs],
        }
        for item in logprobs
    ]
