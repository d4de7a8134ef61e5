"""PLACEHOLDER while the page is built (issue 26): replaced by the page's module."""

from django.http import Http404
from django.urls import path

from controlplane.console.roles import console_view


@console_view("playground")
def page(request, **kwargs):
    raise Http404("not built yet")


urlpatterns = [path("playground", page, name="playground")]
