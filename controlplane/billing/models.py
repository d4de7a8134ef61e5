"""The billing app's models, each in the module of its concept; Django registers them from here."""

from controlplane.billing.budgets import SpendCounter
from controlplane.billing.invoices import Invoice, InvoiceLine
from controlplane.billing.ledger import UsageRecord
from controlplane.billing.usage_days import UsageDay

__all__ = ["Invoice", "InvoiceLine", "SpendCounter", "UsageDay", "UsageRecord"]
