"""What a request costs, in exact decimals (no float anywhere on the money path)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

PER_MILLION = Decimal(1_000_000)


def decimal_string(amount: Decimal) -> str:
    """An exact amount as the API shows it: no trailing zeros, never an exponent ("10", not
    "1E+1"), so a client can parse it back to the same Decimal."""
    return format(amount.normalize(), "f")


@dataclass(frozen=True)
class Costs:
    """USD. Uncached input at the input price, cached input at the cached price."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_savings: Decimal  # what the cached tokens would have cost more at the input price

    @property
    def total(self) -> Decimal:
        return self.input + self.cached_input + self.output


def compute_costs(
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    input_per_mtok: Decimal,
    cached_input_per_mtok: Decimal,
    output_per_mtok: Decimal,
) -> Costs:
    if not 0 <= cached_tokens <= prompt_tokens or completion_tokens < 0:
        raise ValueError(
            f"inconsistent usage: prompt {prompt_tokens}, cached {cached_tokens}, "
            f"completion {completion_tokens}"
        )
    return Costs(
        input=(prompt_tokens - cached_tokens) * input_per_mtok / PER_MILLION,
        cached_input=cached_tokens * cached_input_per_mtok / PER_MILLION,
        output=completion_tokens * output_per_mtok / PER_MILLION,
        cache_savings=cached_tokens * (input_per_mtok - cached_input_per_mtok) / PER_MILLION,
    )
