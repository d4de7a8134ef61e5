"""`manage.py addmodel ID --source WEIGHTS --context-length N [--input --cached-input --output]`:
add a model to the catalog (or update its source and context length) and, when prices are given,
a price row effective now."""

from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError

from controlplane.catalog.models import Price, ServedModel


def _price(value: str, name: str) -> Decimal:
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise CommandError(f"--{name} must be a decimal number, got {value!r}") from None
    if amount < 0:
        raise CommandError(f"--{name} must not be negative")
    return amount


class Command(BaseCommand):
    help = "Add or update a served model, optionally with its prices (USD per 1M tokens)."

    def add_arguments(self, parser):
        parser.add_argument("model_id")
        parser.add_argument("--source", required=True, help="HF directory, .gguf or default name")
        parser.add_argument("--context-length", type=int, required=True)
        parser.add_argument("--input")
        parser.add_argument("--cached-input")
        parser.add_argument("--output")
        parser.add_argument(
            "--async-discount",
            type=int,
            default=0,
            help="whole percent off for async jobs and batch lines",
        )

    def handle(self, *args, model_id: str, source: str, context_length: int, **options):
        if context_length < 1:
            raise CommandError("--context-length must be positive")
        prices = [options["input"], options["cached_input"], options["output"]]
        if any(p is not None for p in prices) and not all(p is not None for p in prices):
            raise CommandError("give all of --input, --cached-input and --output, or none")
        model, _ = ServedModel.objects.update_or_create(
            id=model_id, defaults={"source": source, "context_length": context_length}
        )
        if all(p is not None for p in prices):
            input_price, cached, output = (
                _price(p, n)
                for p, n in zip(prices, ("input", "cached-input", "output"), strict=True)
            )
            if cached > input_price:
                raise CommandError("--cached-input must not exceed --input")
            discount = options["async_discount"]
            if not 0 <= discount <= 100:
                raise CommandError("--async-discount is a whole percent, 0 to 100")
            Price.objects.create(
                model=model,
                input_per_mtok=input_price,
                cached_input_per_mtok=cached,
                output_per_mtok=output,
                async_discount_percent=discount,
            )
        self.stdout.write(model.id)
