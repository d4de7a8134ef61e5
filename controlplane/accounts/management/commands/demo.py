"""`manage.py demo`: seed a demo org, a console user, an API key and the default model with its
demo prices, and print how to use them. Safe to run again: it reuses what exists and issues a
fresh key each time (keys are never stored in the clear, so an old one cannot be shown)."""

from decimal import Decimal

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from controlplane.accounts.models import ApiKey, Membership, Org
from controlplane.catalog.models import Price, ServedModel
from inference.models.loader import DEFAULT_MODEL

DEMO_PRICES = {  # USD per 1M tokens: the input/cached/output ratio Workers AI charges for Kimi K2.5
    "input_per_mtok": Decimal("0.60"),
    "cached_input_per_mtok": Decimal("0.10"),
    "output_per_mtok": Decimal("3.00"),
}
# Off all three for work that can wait (async jobs, batch lines), as OpenAI's Batch API gives.
DEMO_ASYNC_DISCOUNT = 50


class Command(BaseCommand):
    help = "Seed a demo org, user, API key and the default model; print them."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo-password")
        parser.add_argument("--url", default="http://127.0.0.1:8000")

    def handle(self, *args, username: str, password: str, url: str, **options):
        org, _ = Org.objects.get_or_create(slug="demo", defaults={"name": "Demo"})
        user, created = get_user_model().objects.get_or_create(username=username)
        if created:
            user.set_password(password)
            user.save()
        Membership.objects.get_or_create(org=org, user=user, defaults={"role": "owner"})
        model, _ = ServedModel.objects.get_or_create(
            id=DEFAULT_MODEL, defaults={"source": DEFAULT_MODEL, "context_length": 8192}
        )
        if model.current_price() is None:
            Price.objects.create(
                model=model, **DEMO_PRICES, async_discount_percent=DEMO_ASYNC_DISCOUNT
            )
        _, key = ApiKey.objects.create_key(org, "demo")
        shown = password if user.check_password(password) else "(the password you set)"
        self.stdout.write(f"Console:  {url}/console/")
        self.stdout.write(f"Login:    {username} / {shown}")
        self.stdout.write(f"API:      {url}/v1  (model {model.id})")
        self.stdout.write(f"API key:  {key}")
