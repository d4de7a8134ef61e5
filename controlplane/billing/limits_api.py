"""Budgets and rate limits over the API.

- `GET /v1/budget`: the org's monthly budget and this month's use (spent, and reserved by open
  requests), and each key's budget, use and rate limits.
- `POST /v1/budget` `{"monthly_budget_usd": "250.00" | null}`: set or lift the org's budget.
- `POST /v1/api_keys/{prefix}/limits` with any of `monthly_budget_usd`, `requests_per_minute`,
  `tokens_per_minute` (null lifts one): a key's limits; `{prefix}` is the public part of the key
  (`hk_<prefix>_…`), as the console lists it.

Amounts are decimal strings (or JSON numbers) in USD, never negative; limits positive integers.
Any key of the org may change them: keys are the org's credentials (Hearth has no key scopes yet).
Setting a budget starts this month's counter from the ledger (billing/budgets.py).
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.utils import timezone
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.models import BUDGET, ApiKey, Org
from controlplane.billing import budgets
from controlplane.billing.pricing import decimal_string

RATE_FIELDS = ("requests_per_minute", "tokens_per_minute")
LARGEST_BUDGET = Decimal(10) ** (BUDGET["max_digits"] - BUDGET["decimal_places"])


def parse_budget(body: dict, field: str) -> Decimal | None:
    """A budget from the request body: None (no limit) or a non-negative amount in USD."""
    value = body[field]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValidationError({field: ["must be an amount in USD, as a string or a number"]})
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        raise ValidationError({field: [f"{value!r} is not a number"]}) from None
    if not amount.is_finite() or amount < 0:
        raise ValidationError({field: ["must be zero or more"]})
    if amount >= LARGEST_BUDGET or amount.as_tuple().exponent < -BUDGET["decimal_places"]:
        raise ValidationError(
            {field: [f"must be below {LARGEST_BUDGET} with at most 6 decimal places"]}
        )
    return amount


def parse_rate(body: dict, field: str) -> int | None:
    value = body[field]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise ValidationError({field: ["must be a positive integer, or null for no limit"]})
    return value


def _only(body, allowed: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise ValidationError({"body": ["must be a JSON object"]})
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValidationError({unknown[0]: [f"unknown field; expected one of {list(allowed)}"]})
    return body


def _use(org: Org, scope: str, limit: Decimal | None) -> dict:
    use = budgets.usage_this_month(org, scope) or {"spent": "0", "reserved": "0"}
    return {
        "monthly_budget_usd": None if limit is None else decimal_string(limit),
        "spent_usd": use["spent"] if limit is not None else None,
        "reserved_usd": use["reserved"] if limit is not None else None,
    }


def key_limits(key: ApiKey) -> dict:
    return {
        "object": "api_key.limits",
        "id": key.prefix,
        "name": key.name,
        **_use(key.org, budgets.key_scope(key.pk), key.monthly_budget_usd),
        "requests_per_minute": key.requests_per_minute,
        "tokens_per_minute": key.tokens_per_minute,
    }


def budget_object(org: Org) -> dict:
    keys = ApiKey.objects.select_related("org").filter(org=org, revoked_at__isnull=True)
    return {
        "object": "budget",
        "month": budgets.month_of(timezone.now()).strftime("%Y-%m"),
        **_use(org, budgets.ORG_SCOPE, org.monthly_budget_usd),
        "keys": [key_limits(key) for key in keys.order_by("created")],
    }


def _start_counter(org: Org, scope: str) -> None:
    budgets.month_counter(org, scope, budgets.month_of(timezone.now()))


class Budget(APIView):
    def get(self, request: Request) -> Response:
        return Response(budget_object(Org.objects.get(pk=request.user.org.pk)))

    def post(self, request: Request) -> Response:
        body = _only(request.data, ("monthly_budget_usd",))
        if "monthly_budget_usd" not in body:
            raise ValidationError({"monthly_budget_usd": ["is required (null for no limit)"]})
        amount = parse_budget(body, "monthly_budget_usd")
        with transaction.atomic():
            org = Org.objects.select_for_update().get(pk=request.user.org.pk)
            org.monthly_budget_usd = amount
            org.save(update_fields=["monthly_budget_usd"])
            if amount is not None:
                _start_counter(org, budgets.ORG_SCOPE)
        return Response(budget_object(org))


class KeyLimits(APIView):
    def post(self, request: Request, prefix: str) -> Response:
        body = _only(request.data, ("monthly_budget_usd", *RATE_FIELDS))
        changes = {field: parse_rate(body, field) for field in RATE_FIELDS if field in body}
        if "monthly_budget_usd" in body:
            changes["monthly_budget_usd"] = parse_budget(body, "monthly_budget_usd")
        with transaction.atomic():
            key = (
                ApiKey.objects.select_for_update()
                .select_related("org")
                .filter(org=request.user.org, prefix=prefix, revoked_at__isnull=True)
                .first()
            )
            if key is None:
                raise NotFound(f"No active API key with id '{prefix}'.", code="api_key_not_found")
            for field, value in changes.items():
                setattr(key, field, value)
            key.save(update_fields=list(changes))
            if key.monthly_budget_usd is not None:
                _start_counter(key.org, budgets.key_scope(key.pk))
        return Response(key_limits(key))
