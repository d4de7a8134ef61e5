"""The billing API's routes, under /v1/ (included by controlplane/gateway/urls.py)."""

from django.urls import path

from controlplane.billing import api

urlpatterns = [
    path("usage", api.UsageView.as_view()),
    path("invoices", api.InvoiceList.as_view()),
    path("invoices/<str:invoice_id>", api.InvoiceDetail.as_view()),
]
