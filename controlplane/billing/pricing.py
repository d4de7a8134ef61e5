"""What a request costs, in exact decimals (no float anywhere on the money path)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

PER_MILLION = Decimal(1_000_000)
HUNDRED = Decimal(100)


def decimal_string(amount: Decimal) -> str:
    """An exact amount as the API shows it: no trailing zeros, never an exponent ("10", not
    "1E+1"), so a client can parse it back to the same Decimal."""
    return format(amount.normalize(), "f")


def cost_object(amounts) -> dict[str, str]:
    """Costs as the API shows them (a job's `cost`, a report's totals): decimal strings in USD,
    from anything with the ledger's cost fields."""
    return {
        "currency": "USD",
        "input": decimal_string(amounts.input_cost),
        "cached_input": decimal_string(amounts.cached_input_cost),
        "output": decimal_string(amounts.output_cost),
        "total": decimal_string(amounts.total_cost),
        "cache_savings": decimal_string(amounts.cache_savings),
    }


@dataclass(frozen=True)
class Costs:
    """USD. Uncached input at the input price, cached input at the cached price; each part less
    the discount, when one applied."""

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
    discount_percent: int = 0,
) -> Costs:
    """Exact: a price has at most 6 decimals and a discount is a whole percent, so every part
    has at most 14 (the ledger keeps 14)."""
    if not 0 <= cached_tokens <= prompt_tokens or completion_tokens < 0:
        raise ValueError(
            f"inconsistent usage: prompt {prompt_tokens}, cached {cached_tokens}, "
            f"completion {completion_tokens}"
        )
    if not (isinstance(discount_percent, int) and 0 <= discount_percent <= 100):
        raise ValueError(f"a discount is a whole percent, 0-100, not {discount_percent!r}")
    share = (HUNDRED - discount_percent) / HUNDRED
    return Costs(
        input=(prompt_tokens - cached_tokens) * input_per_mtok / PER_MILLION * share,
        cached_input=cached_tokens * cached_input_per_mtok / PER_MILLION * share,
        output=completion_tokens * output_per_mtok / PER_MILLION * share,
        cache_savings=cached_tokens
        * (input_per_mtok - cached_input_per_mtok)
        / PER_MILLION
        * share,
    )


def max_cost(price, prompt_tokens: int, max_tokens: int, discount_percent: int) -> Decimal:
    """The most a request can cost: no prompt token cached, every allowed token generated."""
    return compute_costs(
        prompt_tokens,
        0,
        max_tokens,
        price.input_per_mtok,
        price.cached_input_per_mtok,
        price.output_per_mtok,
        discount_percent,
    ).total
