"""Per-request generation parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference.errors import InvalidRequestError
from inference.structured.spec import check_spec


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `seed` makes a sampled request reproducible on its own,
    whatever else shares its batch. Penalties follow their usual definitions: `repetition_penalty`
    (CTRL / Hugging Face, over prompt and output), `presence_penalty` and `frequency_penalty`
    (OpenAI, over the output). `logprobs` returns the sampled token's log-probability under the
    model's raw distribution, `top_logprobs` the n most likely alternatives. `logit_bias` adds
    its value (-100 to 100) to a token's logit before sampling (OpenAI's). `structured` constrains
    the output to a grammar (inference/structured/spec.py: a JSON schema, any JSON object, or
    tool calls).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):  # JSON keys arrive as strings
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    "logit_bias maps token ids to numbers", param="logit_bias"
                ) from None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first invalid field."""
        checks = [
            (
                self.max_tokens is None
                or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "max_tokens",
                "must be an integer >= 1",
            ),
            (0.0 <= self.temperature <= 100.0, "temperature", "must be between 0 and 100"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (
                isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20,
                "top_logprobs",
                "must be an integer in [0, 20]",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "must be non-empty strings",
            ),
            (len(self.stop) <= 16, "stop", "accepts at most 16 strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be non-negative integers",
            ),
            (self.seed is None or isinstance(self.seed, int), "seed", "must be an integer"),
            (
                isinstance(self.logit_bias, dict)
                and all(k >= 0 and -100.0 <= v <= 100.0 for k, v in self.logit_bias.items()),
                "logit_bias",
                "must map non-negative token ids to numbers in [-100, 100]",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)!r}", param=name)
        if self.structured is not None:
            check_spec(self.structured)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=True", param="top_logprobs")
