"""OpenAI-style list pages: `{object: "list", data, first_id, last_id, has_more}`, newest first,
`limit` per page and `after=<id>` for the next, as a keyset on (created, id) so pages stay stable
while rows are added."""

from __future__ import annotations

from django.db.models import Q
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def page_limit(raw: str | None) -> int:
    """The `limit` query parameter: 1 to 100, 20 when absent; a 400 naming it otherwise."""
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise ValidationError({"limit": [f"'limit' must be an integer from 1 to {MAX_LIMIT}."]})
    return int(raw)


def cursor_page(rows, model, request: Request, as_object) -> Response:
    """Newest first, `limit` per page, `after=<id>` for the next (a keyset on (created, id))."""
    limit = page_limit(request.query_params.get("limit"))
    after = request.query_params.get("after")
    if after is not None:
        cursor = model.objects.filter(id=after, org=request.user.org).first()
        if cursor is None:
            raise ValidationError({"after": [f"No object with id '{after}'."]})
        rows = rows.filter(
            Q(created__lt=cursor.created) | Q(created=cursor.created, id__lt=cursor.id)
        )
    page = list(rows.order_by("-created", "-id")[: limit + 1])
    data = [as_object(row) for row in page[:limit]]
    return Response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(page) > limit,
        }
    )
