"""What Hearth serves and at what price.

Prices are USD per million tokens, exact decimals. A price row takes effect at `effective_from`;
a change adds a row instead of editing one, so what a past request was charged can always be
read back.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ServedModel(models.Model):
    """A model the platform serves, under its public id."""

    id = models.CharField(primary_key=True, max_length=200)
    # A local Hugging Face directory, a .gguf file, or the packaged default's name.
    source = models.CharField(max_length=500)
    context_length = models.PositiveIntegerField()
    owned_by = models.CharField(max_length=100, default="hearth")
    enabled = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.id

    def current_price(self, at=None) -> Price | None:
        return self.prices.filter(effective_from__lte=at or timezone.now()).first()


class Price(models.Model):
    """USD per 1M tokens for one model from `effective_from` on."""

    model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="prices")
    effective_from = models.DateTimeField(default=timezone.now)
    input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    cached_input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    output_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)

    class Meta:
        ordering = ["-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "effective_from"], name="one_price_per_instant"
            ),
            models.CheckConstraint(
                condition=models.Q(cached_input_per_mtok__lte=models.F("input_per_mtok")),
                name="cached_input_not_dearer",
            ),
        ]
