"""The console's members page: who belongs to the org, with which role; owners and admins invite
an existing user by user name, change a member's role and remove a member.

The rules, beyond the role table (console/roles.py):
- only an owner grants the owner role, and only an owner changes or removes an owner;
- the org keeps at least one owner: demoting or removing the last one is refused;
- nobody removes themselves (another owner or admin does), so nobody strands themselves in no org;
- an invitation makes the user a member at once (there is no pending invitation to accept); a user
  who is already in another org keeps acting in their first one (console_view).
A refused action re-renders the page with the reason; a membership of another org is a 404.
"""

from __future__ import annotations

from django import forms
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.views.decorators.http import require_GET, require_POST

from controlplane.accounts.models import Membership
from controlplane.console.roles import OWNER, console_view


class MembershipRefused(Exception):
    """An action on a membership that the rules above forbid; the message says which."""


class InviteForm(forms.Form):
    username = forms.CharField(max_length=150, strip=True, label="User name")
    role = forms.ChoiceField(choices=Membership.ROLES, initial=Membership.DEVELOPER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Membership.ROLES)


def _check_owner_rules(actor: Membership, *roles: str) -> None:
    """Refuse a non-owner's act that involves the owner role: `roles` are the target's role
    now and the one it would get."""
    if actor.role != OWNER and OWNER in roles:
        raise MembershipRefused("Only an owner can grant the owner role or change an owner.")


def _keep_an_owner(target: Membership) -> None:
    """Refuse to take the org's last owner away. Called inside the transaction that changes the
    target: the owners' rows stay locked until it commits, so two owners demoting each other at
    once cannot both pass the count."""
    owners = list(
        Membership.objects.select_for_update()
        .filter(org_id=target.org_id, role=OWNER)
        .values_list("pk", flat=True)
    )
    if owners == [target.pk]:
        raise MembershipRefused("The org must keep at least one owner: make another owner first.")


def invite(actor: Membership, username: str, role: str) -> Membership:
    """Make the existing user `username` a member of the actor's org with `role`."""
    _check_owner_rules(actor, role)
    user_model = get_user_model()
    user = user_model.objects.filter(**{user_model.USERNAME_FIELD: username}).first()
    if user is None:
        raise MembershipRefused(f"There is no user named “{username}”.")
    try:
        with transaction.atomic():
            return Membership.objects.create(org_id=actor.org_id, user=user, role=role)
    except IntegrityError:
        # The unique (org, user) constraint: checked by the database, so two invitations at once
        # cannot both succeed.
        raise MembershipRefused(f"“{username}” is already a member of this org.") from None


def change_role(actor: Membership, target: Membership, role: str) -> None:
    _check_owner_rules(actor, target.role, role)
    with transaction.atomic():
        if target.role == OWNER and role != OWNER:
            _keep_an_owner(target)
        Membership.objects.filter(pk=target.pk).update(role=role)


def remove(actor: Membership, target: Membership) -> None:
    if target.pk == actor.pk:
        raise MembershipRefused("You cannot remove yourself: another owner or admin can.")
    _check_owner_rules(actor, target.role)
    with transaction.atomic():
        if target.role == OWNER:
            _keep_an_owner(target)
        target.delete()


def page(
    request: HttpRequest, invite_form: InviteForm | None = None, problem: str = ""
) -> HttpResponse:
    """The member list, with the controls the viewer's role may use; `problem` says why the
    action just asked for was refused."""
    members = (
        Membership.objects.filter(org=request.org).select_related("user").order_by("created", "pk")
    )
    is_owner = request.membership.role == OWNER
    roles = [(value, label) for value, label in Membership.ROLES if is_owner or value != OWNER]
    rows = [
        {
            "membership": member,
            "is_me": member.pk == request.membership.pk,
            # What the rules let the viewer do to this member (the views check again).
            "manageable": "manage_members" in request.permissions
            and (is_owner or member.role != OWNER),
        }
        for member in members
    ]
    context = {
        "rows": rows,
        "roles": roles,
        "invite_form": invite_form or InviteForm(),
        "problem": problem,
    }
    return render(request, "console/members.html", context)


@require_GET
@console_view("members")
def members(request: HttpRequest) -> HttpResponse:
    return page(request)


@require_POST
@console_view("manage_members")
def invite_member(request: HttpRequest) -> HttpResponse:
    form = InviteForm(request.POST)
    if not form.is_valid():
        return page(request, invite_form=form)
    try:
        invite(request.membership, form.cleaned_data["username"], form.cleaned_data["role"])
    except MembershipRefused as exc:
        form.add_error("username", str(exc))
        return page(request, invite_form=form)
    return redirect("console:members")


@require_POST
@console_view("manage_members")
def change_member_role(request: HttpRequest, membership_id: int) -> HttpResponse:
    target = get_object_or_404(Membership, pk=membership_id, org=request.org)
    form = RoleForm(request.POST)
    if not form.is_valid():
        return page(request, problem="Choose one of the roles listed.")
    try:
        change_role(request.membership, target, form.cleaned_data["role"])
    except MembershipRefused as exc:
        return page(request, problem=str(exc))
    return redirect("console:members")


@require_POST
@console_view("manage_members")
def remove_member(request: HttpRequest, membership_id: int) -> HttpResponse:
    target = get_object_or_404(Membership, pk=membership_id, org=request.org)
    try:
        remove(request.membership, target)
    except MembershipRefused as exc:
        return page(request, problem=str(exc))
    return redirect("console:members")


urlpatterns = [
    path("members", members, name="members"),
    path("members/invite", invite_member, name="invite-member"),
    path("members/<int:membership_id>/role", change_member_role, name="member-role"),
    path("members/<int:membership_id>/remove", remove_member, name="remove-member"),
]
