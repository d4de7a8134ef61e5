"""The web console: API keys and a live jobs table, for the signed-in user's org.

Views are thin: `console_view` finds the user's org and checks their role (console/roles.py);
the view fetches within that org, calls one model method, renders. Another org's key or job is a
404, never a 403 that would confirm it exists.
"""

from __future__ import annotations

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.accounts.models import ApiKey
from controlplane.console.roles import console_view
from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object

# The jobs page shows this many of the newest jobs; the live updates keep it at that length.
JOBS_SHOWN = 100


class NewKeyForm(forms.Form):
    """The name a new API key is listed under."""

    name = forms.CharField(max_length=ApiKey._meta.get_field("name").max_length, strip=True)


def key_status(key: ApiKey, now) -> str:
    """`active`, `revoked` or `expired`, as the authentication check would judge the key."""
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= now:
        return "expired"
    return "active"


@require_http_methods(["GET", "POST"])
@console_view("keys")
def keys(request: HttpRequest) -> HttpResponse:
    """List the org's keys; POST creates one and shows its full secret in this response only
    (no redirect: the secret must not travel through a URL or the session)."""
    form = NewKeyForm(request.POST) if request.method == "POST" else NewKeyForm()
    new_key = new_secret = None
    if form.is_bound and form.is_valid():
        new_key, new_secret = ApiKey.objects.create_key(request.org, form.cleaned_data["name"])
        form = NewKeyForm()
    now = timezone.now()
    rows = [
        {"key": key, "status": key_status(key, now)}
        for key in ApiKey.objects.filter(org=request.org).order_by("-created")
    ]
    context = {"rows": rows, "form": form, "new_key": new_key, "new_secret": new_secret}
    response = render(request, "console/keys.html", context)
    if new_secret:
        # Keep the one copy of the secret out of every cache, the browser's back button included.
        response["Cache-Control"] = "no-store"
    return response


@require_POST
@console_view("keys")
def revoke_key(request: HttpRequest, key_id: int) -> HttpResponse:
    """Revoke one of the org's keys (another org's key is a 404)."""
    get_object_or_404(ApiKey, pk=key_id, org=request.org).revoke()
    return redirect("console:keys")


@require_GET
@console_view("jobs")
def jobs(request: HttpRequest) -> HttpResponse:
    """The org's newest jobs as the API shows them; the page's script keeps them live."""
    Job.objects.expire_overdue(org=request.org)
    newest = Job.objects.filter(org=request.org).order_by("-created")[:JOBS_SHOWN]
    rows = [{**job_object(job), "created_at": job.created} for job in newest]
    return render(request, "console/jobs.html", {"jobs": rows, "jobs_shown": JOBS_SHOWN})
