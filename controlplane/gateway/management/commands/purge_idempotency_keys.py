"""`manage.py purge_idempotency_keys`: delete the idempotency keys past their 24 hours."""

from django.core.management.base import BaseCommand

from controlplane.gateway.models import IdempotencyKey


class Command(BaseCommand):
    help = "Delete expired Idempotency-Key rows (kept 24 hours); prints how many."

    def handle(self, *args, **options):
        deleted = IdempotencyKey.objects.purge_expired()
        self.stdout.write(f"{deleted} expired idempotency keys deleted")
