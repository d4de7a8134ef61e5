"""The billing API: `GET /v1/usage`, `GET /v1/invoices`, `GET /v1/invoices/{id}`.

Everything is the calling key's org's; another org's invoice is a 404, never a 403.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.http import HttpResponse
from django.utils import timezone
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.billing.invoices import Invoice
from controlplane.billing.reports import GROUPINGS, UsageReport, month_bounds


class JsonErrors(BaseContentNegotiation):
    """DRF renders with JSON whatever the client accepts, so errors keep OpenAI's shape; the
    usage view answers CSV itself. (DRF's default would 404 `?format=csv`, a format it has no
    renderer for.)"""

    def select_parser(self, request, parsers):
        return parsers[0]

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


def parse_instant(params, name: str, default: datetime) -> datetime:
    """Query parameter `name` as a UTC instant: an ISO 8601 date (its midnight) or date-time
    (without an offset, UTC); `default` when absent; a 400 naming it otherwise."""
    raw = params.get(name)
    if raw is None:
        return default
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise ValidationError(
            {name: [f"'{name}' must be an ISO 8601 date or date-time, got {raw!r}."]}
        ) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def wants_csv(request: Request) -> bool:
    """`?format=csv`, or `text/csv` in the Accept header; `?format=` other than csv or json is a
    400."""
    chosen = request.query_params.get("format")
    if chosen is not None:
        if chosen not in ("csv", "json"):
            raise ValidationError({"format": ["'format' must be 'json' or 'csv'."]})
        return chosen == "csv"
    accepted = request.headers.get("Accept", "")
    return any(part.split(";")[0].strip() == "text/csv" for part in accepted.split(","))


class UsageView(APIView):
    """Totals of the org's usage in `[start, end)`, UTC (`end` exclusive; the current month by
    default), per `group_by` (`day`, `model` or `key`; `day` by default), and overall."""

    content_negotiation_class = JsonErrors

    def get(self, request: Request) -> HttpResponse:
        params = request.query_params
        month_start, month_end = month_bounds(timezone.now().date())
        start = parse_instant(params, "start", month_start)
        end = parse_instant(params, "end", month_end)
        if start > end:
            raise ValidationError({"start": ["'start' must not be after 'end'."]})
        group_by = params.get("group_by", "day")
        if group_by not in GROUPINGS:
            raise ValidationError({"group_by": [f"'group_by' must be one of {list(GROUPINGS)}."]})
        as_csv = wants_csv(request)
        report = UsageReport.build(request.user.org, start, end, group_by)
        if as_csv:
            response = HttpResponse(report.as_csv(), content_type="text/csv; charset=utf-8")
            filename = f"usage-{group_by}-{start:%Y%m%d}-{end:%Y%m%d}.csv"
            response["Content-Disposition"] = f'attachment; filename="{filename}"'
            return response
        return Response(report.as_object())


class InvoiceList(APIView):
    """The org's monthly invoices, newest first (a year is twelve: no pages)."""

    def get(self, request: Request) -> Response:
        invoices = Invoice.objects.for_org(request.user.org)
        return Response({"object": "list", "data": [invoice.as_object() for invoice in invoices]})


class InvoiceDetail(APIView):
    def get(self, request: Request, invoice_id: str) -> Response:
        invoice = Invoice.objects.filter(id=invoice_id, org=request.user.org).first()
        if invoice is None:
            raise NotFound(f"No invoice with id '{invoice_id}'.", code="invoice_not_found")
        invoice.finalize_if_due(timezone.now())
        return Response(invoice.as_object())
