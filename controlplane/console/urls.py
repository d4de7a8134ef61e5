"""The web console's routes, under /console/ (controlplane/urls.py). Each page's module lists its
own routes (`urlpatterns`); this joins them."""

from django.contrib.auth import views as auth_views
from django.urls import path

from controlplane.console import (
    batches,
    billing,
    dashboard,
    fleet,
    job_page,
    members,
    playground,
    views,
    webhooks,
)

app_name = "console"

urlpatterns = [
    path(
        "login",
        auth_views.LoginView.as_view(
            template_name="console/login.html", redirect_authenticated_user=True
        ),
        name="login",
    ),
    # Django's LogoutView accepts only POST, so a link or prefetch cannot sign anyone out.
    path("logout", auth_views.LogoutView.as_view(), name="logout"),
    path("keys", views.keys, name="keys"),
    path("keys/<int:key_id>/revoke", views.revoke_key, name="revoke-key"),
    path("jobs", views.jobs, name="jobs"),
    path("billing", billing.billing, name="billing"),
    path("billing/usage.csv", billing.usage_csv, name="usage-csv"),
    path("billing/invoices/<str:invoice_id>", billing.invoice, name="invoice"),
    *dashboard.urlpatterns,  # "" is the dashboard, named "overview"
    *playground.urlpatterns,
    *fleet.urlpatterns,
    *job_page.urlpatterns,
    *batches.urlpatterns,
    *webhooks.urlpatterns,
    *members.urlpatterns,
]
