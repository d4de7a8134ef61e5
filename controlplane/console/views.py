"""The web console: API keys and a live jobs table, for the signed-in user's org.

Views are thin: find the user's org, fetch within it, call one model method, render. Everything
is scoped to that org, so another org's key or job is a 404, never a 403 that would confirm it
exists.
"""

from __future__ import annotations

from functools import wraps

from django import forms
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.accounts.models import ApiKey, Membership
from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object

# The jobs page shows this many of the newest jobs; the live updates keep it at that length.
JOBS_SHOWN = 100


def org_member_required(view):
    """`login_required`, then `request.org`: the user's first org (by membership date). A user
    in no org has nothing to see here."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        membership = (
            Membership.objects.filter(user=request.user).select_related("org").order_by("created")
        ).first()
        if membership is None:
            raise Http404("You are not a member of any organisation.")
        request.org = membership.org
        return view(request, *args, **kwargs)

    return wrapper


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


@require_GET
@org_member_required
def overview(request: HttpRequest) -> HttpResponse:
    """The console's front page is the jobs table."""
    return redirect("console:jobs")


@require_http_methods(["GET", "POST"])
@org_member_required
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
@org_member_required
def revoke_key(request: HttpRequest, key_id: int) -> HttpResponse:
    """Revoke one of the org's keys (another org's key is a 404)."""
    get_object_or_404(ApiKey, pk=key_id, org=request.org).revoke()
    return redirect("console:keys")


@require_GET
@org_member_required
def jobs(request: HttpRequest) -> HttpResponse:
    """The org's newest jobs as the API shows them; the page's script keeps them live."""
    Job.objects.expire_overdue(org=request.org)
    newest = Job.objects.filter(org=request.org).order_by("-created")[:JOBS_SHOWN]
    rows = [{**job_object(job), "created_at": job.created} for job in newest]
    return render(request, "console/jobs.html", {"jobs": rows, "jobs_shown": JOBS_SHOWN})
