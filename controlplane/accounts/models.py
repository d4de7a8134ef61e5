"""Organisations, their members, and their API keys.

An API key reads `hk_<prefix>_<secret>`: the 12-character prefix is public (shown in the console,
used to find the row), the secret is 256 random bits of which only the SHA-256 is stored. With
that much entropy a plain SHA-256 cannot be brute-forced, and it does not tie every key to
SECRET_KEY as an HMAC would.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone

KEY_PATTERN = re.compile(r"^hk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
# last_used_at is written at most this often per key, so authentication is not a write per request.
LAST_USED_RESOLUTION = timedelta(seconds=60)
# How long a gateway process trusts a key it authenticated (ApiKeyManager.authenticate).
AUTH_CACHE_S = 1.0
_authenticated: dict[str, tuple[float, ApiKey]] = {}
# Budgets in USD, to the micro-dollar.
BUDGET = {"max_digits": 18, "decimal_places": 6}


class Org(models.Model):
    """A tenant: it owns keys, jobs and usage, and scopes the prefix cache."""

    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    created = models.DateTimeField(auto_now_add=True)
    # USD per calendar month (UTC), enforced at admission (controlplane/billing/budgets.py);
    # null: no limit.
    monthly_budget_usd = models.DecimalField(**BUDGET, null=True, blank=True)

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    """A console user's access to an org, with a role: what each role may do in the console is
    `controlplane/console/roles.py`'s table."""

    OWNER, ADMIN, DEVELOPER, BILLING = "owner", "admin", "developer", "billing"
    ROLES = [
        (OWNER, "Owner"),
        (ADMIN, "Admin"),
        (DEVELOPER, "Developer"),
        (BILLING, "Billing viewer"),
    ]

    org = models.ForeignKey(Org, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=ROLES, default=DEVELOPER)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["org", "user"], name="one_membership")]


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyRejected(Exception):
    """Why a presented key does not authenticate: `code` is OpenAI-style."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ApiKeyManager(models.Manager["ApiKey"]):
    def create_key(self, org: Org, name: str, expires_at=None) -> tuple[ApiKey, str]:
        """A new key for `org`; returns the row and the full key, which is never stored."""
        prefix = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        key = self.create(
            org=org,
            name=name,
            prefix=prefix,
            secret_hash=hash_secret(secret),
            expires_at=expires_at,
        )
        return key, f"hk_{prefix}_{secret}"

    def authenticate(self, presented: str) -> ApiKey:
        """The active key `presented` stands for; raises KeyRejected otherwise.

        A key that authenticated is kept for AUTH_CACHE_S per process, with its org: the lookup
        is a large part of what admitting a completion costs the gateway (docs/performance.md).
        A change to a key or org saved in the same process clears the cache at once; one made
        elsewhere (a revocation, a new limit) takes effect within AUTH_CACHE_S."""
        digest = hash_secret(presented)
        hit = _authenticated.get(digest)
        if hit is not None and time.monotonic() - hit[0] < AUTH_CACHE_S:
            key = hit[1]
            if key.expires_at is None or key.expires_at > timezone.now():
                key.touch()
                return key
        key = self._authenticate(presented)
        _authenticated[digest] = (time.monotonic(), key)
        return key

    def _authenticate(self, presented: str) -> ApiKey:
        match = KEY_PATTERN.match(presented)
        if match is None:
            raise KeyRejected("Malformed API key.", "invalid_api_key")
        prefix, secret = match.groups()
        key = self.select_related("org").filter(prefix=prefix).first()
        # Compare even when no row matched, so timing does not tell which prefixes exist.
        stored = key.secret_hash if key else hash_secret(prefix)
        if not hmac.compare_digest(stored, hash_secret(secret)) or key is None:
            raise KeyRejected("Incorrect API key provided.", "invalid_api_key")
        if key.revoked_at is not None:
            raise KeyRejected("This API key has been revoked.", "revoked_api_key")
        if key.expires_at is not None and key.expires_at <= timezone.now():
            raise KeyRejected("This API key has expired.", "expired_api_key")
        key.touch()
        return key


class ApiKey(models.Model):
    """A bearer credential of one org."""

    org = models.ForeignKey(Org, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=12, unique=True)
    secret_hash = models.CharField(max_length=64)
    created = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    # Limits of this key; null: none (controlplane/billing/budgets.py, ratelimit.py).
    monthly_budget_usd = models.DecimalField(**BUDGET, null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)

    objects = ApiKeyManager()

    def __str__(self) -> str:
        return f"{self.org.slug}/{self.name} (hk_{self.prefix}_…)"

    def revoke(self) -> bool:
        """Revoke the key; False if it already was (the conditional update makes it once)."""
        now = timezone.now()
        updated = ApiKey.objects.filter(pk=self.pk, revoked_at__isnull=True).update(revoked_at=now)
        if updated:
            self.revoked_at = now
            _authenticated.clear()
        return bool(updated)

    def touch(self) -> None:
        """Record use, at most once per LAST_USED_RESOLUTION."""
        now = timezone.now()
        if self.last_used_at is not None and self.last_used_at >= now - LAST_USED_RESOLUTION:
            return  # the row just read is fresh enough: no round trip
        stale = models.Q(last_used_at__isnull=True) | models.Q(
            last_used_at__lt=now - LAST_USED_RESOLUTION
        )
        if ApiKey.objects.filter(stale, pk=self.pk).update(last_used_at=now):
            self.last_used_at = now


@receiver(post_save, sender=ApiKey)
@receiver(post_delete, sender=ApiKey)
@receiver(post_save, sender=Org)
@receiver(post_delete, sender=Org)
def _forget_authenticated_keys(**kwargs) -> None:
    _authenticated.clear()
