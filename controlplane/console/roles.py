"""Who may do what in the console: each page and action names a permission, each role holds a set
of them, and `console_view` checks it before the view runs.

The roles (accounts.Membership): an owner does everything; an admin too, except that only an owner
makes or unmakes owners; a developer works with the API (keys, the playground, jobs, batches,
webhooks, the fleet) and does not see invoices or manage members; a billing viewer sees the
dashboard, billing and the member list, and changes nothing.

A signed-in user acts in their first org (by membership date). Whatever belongs to another org is a
404, never a 403 that would confirm it exists; a page of their own org their role may not see is
a 403 that names the role.
"""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.accounts.models import Membership

OWNER, ADMIN, DEVELOPER, BILLING = (
    Membership.OWNER,
    Membership.ADMIN,
    Membership.DEVELOPER,
    Membership.BILLING,
)
EVERYONE = frozenset({OWNER, ADMIN, DEVELOPER, BILLING})
BUILDERS = frozenset({OWNER, ADMIN, DEVELOPER})

# Each permission: the roles that hold it.
PERMISSIONS: dict[str, frozenset[str]] = {
    "dashboard": EVERYONE,
    "playground": BUILDERS,
    "jobs": BUILDERS,
    "cancel_job": BUILDERS,
    "batches": BUILDERS,
    "fleet": BUILDERS,
    "keys": BUILDERS,
    "webhooks": BUILDERS,
    "billing": frozenset({OWNER, ADMIN, BILLING}),
    "members": EVERYONE,
    "manage_members": frozenset({OWNER, ADMIN}),
}


def allowed(role: str, permission: str) -> bool:
    return role in PERMISSIONS[permission]


def permissions_of(role: str) -> frozenset[str]:
    return frozenset(name for name, roles in PERMISSIONS.items() if role in roles)


def console_view(permission: str):
    """`login_required`, then the user's org and role on the request (`request.org`,
    `request.membership`, `request.permissions` for the templates), then `permission`: a 403
    page naming the role when the role lacks it. A user in no org has nothing to see here."""
    if permission not in PERMISSIONS:
        raise ValueError(f"unknown console permission {permission!r}")

    def decorate(view):
        @login_required
        @wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            membership = (
                Membership.objects.filter(user=request.user)
                .select_related("org")
                .order_by("created")
                .first()
            )
            if membership is None:
                raise Http404("You are not a member of any organisation.")
            request.org, request.membership = membership.org, membership
            request.permissions = permissions_of(membership.role)
            if permission not in request.permissions:
                context = {"role": membership.get_role_display(), "permission": permission}
                return render(request, "console/forbidden.html", context, status=403)
            return view(request, *args, **kwargs)

        return wrapper

    return decorate
