"""`manage.py createorg SLUG [--name NAME]`: create an organisation."""

from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts.models import Org


class Command(BaseCommand):
    help = "Create an organisation."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", default="")

    def handle(self, *args, slug: str, name: str, **options):
        org, created = Org.objects.get_or_create(slug=slug, defaults={"name": name or slug})
        if not created:
            raise CommandError(f"org {slug!r} already exists")
        self.stdout.write(org.slug)
