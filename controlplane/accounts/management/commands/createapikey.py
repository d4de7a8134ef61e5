"""`manage.py createapikey --org SLUG --name NAME`: print a new key, and only the key."""

from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts.models import ApiKey, Org


class Command(BaseCommand):
    help = "Create an API key for an org and print it (it is not stored and cannot be shown again)."

    def add_arguments(self, parser):
        parser.add_argument("--org", required=True, help="the org's slug")
        parser.add_argument("--name", required=True, help="a label for the key")

    def handle(self, *args, org: str, name: str, **options):
        try:
            owner = Org.objects.get(slug=org)
        except Org.DoesNotExist:
            raise CommandError(f"no org {org!r}") from None
        _, key = ApiKey.objects.create_key(owner, name)
        self.stdout.write(key)
