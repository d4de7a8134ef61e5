"""What Hearth serves and at what price.

Prices are USD per million tokens, exact decimals. A price row takes effect at `effective_from`;
a change adds a row instead of editing one, so what a past request was charged can always be
read back.
"""

from __future__ import annotations

import time

from django.db import models
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone

# How long a gateway process reuses a catalog row it read: the admission path reads one per
# request (a query: docs/performance.md). A model disabled or changed elsewhere is seen within
# this; a change made in the same process clears the cache at once.
CATALOG_CACHE_S = 1.0
_enabled_cache: dict[str, tuple[float, ServedModel]] = {}


class ServedModelManager(models.Manager["ServedModel"]):
    def enabled(self, model_id: str) -> ServedModel | None:
        """The enabled model `model_id`, read from the database at most every CATALOG_CACHE_S
        per process (a miss is never cached, so a new model is served at once)."""
        now = time.monotonic()
        hit = _enabled_cache.get(model_id)
        if hit is not None and now - hit[0] < CATALOG_CACHE_S:
            return hit[1]
        model = self.filter(id=model_id, enabled=True).first()
        if model is None:
            _enabled_cache.pop(model_id, None)
        else:
            _enabled_cache[model_id] = (now, model)
        return model


class ServedModel(models.Model):
    """A model the platform serves, under its public id."""

    id = models.CharField(primary_key=True, max_length=200)
    # A local Hugging Face directory, a .gguf file, or the packaged default's name.
    source = models.CharField(max_length=500)
    context_length = models.PositiveIntegerField()
    owned_by = models.CharField(max_length=100, default="hearth")
    enabled = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)

    objects = ServedModelManager()

    def __str__(self) -> str:
        return self.id

    def current_price(self, at=None) -> Price | None:
        """The price in effect at `at` (now by default)."""
        return price_in_effect(self.pk, at)


def price_in_effect(model_id: str, at=None) -> Price | None:
    """The price of catalog model `model_id` in effect at `at` (now by default): one query."""
    return Price.objects.filter(model_id=model_id, effective_from__lte=at or timezone.now()).first()


class Price(models.Model):
    """USD per 1M tokens for one model from `effective_from` on, and the discount, in percent,
    that asynchronous jobs and batch lines get off all three."""

    model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="prices")
    effective_from = models.DateTimeField(default=timezone.now)
    input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    cached_input_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    output_per_mtok = models.DecimalField(max_digits=12, decimal_places=6)
    # Whole percent: with a price's 6 decimals, every cost then fits the ledger's 14 exactly.
    async_discount_percent = models.PositiveSmallIntegerField(default=0)

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
            models.CheckConstraint(
                condition=models.Q(async_discount_percent__gte=0, async_discount_percent__lte=100),
                name="discount_is_a_percentage",
            ),
        ]


@receiver(post_save, sender=ServedModel)
@receiver(post_delete, sender=ServedModel)
def _forget_cached_models(**kwargs) -> None:
    _enabled_cache.clear()
