"""`GET /openapi.json`: the document, open to anyone, built once per process: it depends only on
the code, and an unauthenticated endpoint should not rebuild it for
every request."""

from __future__ import annotations

import threading

from drf_spectacular.renderers import OpenApiJsonRenderer, OpenApiJsonRenderer2
from drf_spectacular.views import SpectacularAPIView
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

import controlplane.openapi.hooks  # noqa: F401  (registers the API key's security scheme)


class OpenApiDocument(SpectacularAPIView):
    """The OpenAPI 3.1 document as JSON (`application/json` unless the client asks for
    `application/vnd.oai.openapi+json`)."""

    renderer_classes = [OpenApiJsonRenderer2, OpenApiJsonRenderer]
    authentication_classes: list = []
    permission_classes = [AllowAny]

    _built: dict | None = None
    _lock = threading.Lock()

    def _get_schema_response(self, request) -> Response:
        with OpenApiDocument._lock:
            if OpenApiDocument._built is None:
                generator = self.generator_class(urlconf=self.urlconf, patterns=self.patterns)
                OpenApiDocument._built = generator.get_schema(request=None, public=True)
        return Response(OpenApiDocument._built)
