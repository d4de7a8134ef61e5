"""Hearth's Django settings: one module, configured from the environment.

With no `DATABASE_URL` Hearth runs embedded on SQLite under `HEARTH_DATA_DIR`; with
`DATABASE_URL=postgres://…` it uses PostgreSQL through psycopg 3 (DESIGN §1).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def database_from_url(url: str) -> dict:
    """A Django DATABASES entry from `postgres://user:password@host:port/name`."""
    parsed = urlparse(url)
    if parsed.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL must be postgres://…, got scheme {parsed.scheme!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")) or "hearth",
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": parsed.hostname or "",
        "PORT": str(parsed.port or ""),
        # Under ASGI, persistent connections leak across threads (Django's docs): none.
        "CONN_MAX_AGE": 0,
    }


DATA_DIR = Path(env_str("HEARTH_DATA_DIR", str(BASE_DIR / ".hearth")))
DEBUG = env_bool("HEARTH_DEBUG", False)
# Embedded mode on a laptop gets a fixed development key; production must set its own.
SECRET_KEY = env_str("HEARTH_SECRET_KEY", "hearth-embedded-development-key-not-for-production")
ALLOWED_HOSTS = [
    h for h in env_str("HEARTH_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h
]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework",
    "django_dramatiq",
    "controlplane.accounts",
    "controlplane.catalog",
    "controlplane.billing",
    "controlplane.jobs",
    "controlplane.gateway",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

if env_str("DATABASE_URL"):
    DATABASES = {"default": database_from_url(env_str("DATABASE_URL"))}
else:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(DATA_DIR / "hearth.sqlite3"),
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    }
]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["controlplane.accounts.authentication.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "controlplane.gateway.errors.openai_exception_handler",
    "UNAUTHENTICATED_USER": None,
}

STATIC_URL = "/static/"
STATIC_ROOT = DATA_DIR / "static"

# Dramatiq: Redis (or RabbitMQ with BROKER_URL=amqp://…) in production, the in-process StubBroker
# in embedded mode. Nodes use the same broker and namespace (`python -m inference.node`).
REDIS_URL = env_str("REDIS_URL")
BROKER_URL = env_str("BROKER_URL") or REDIS_URL
_DRAMATIQ_MIDDLEWARE = [
    "dramatiq.middleware.AgeLimit",
    "dramatiq.middleware.TimeLimit",
    "dramatiq.middleware.Callbacks",
    "dramatiq.middleware.Retries",
    "django_dramatiq.middleware.DbConnectionsMiddleware",
]
if BROKER_URL.startswith("amqp"):
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq.brokers.rabbitmq.RabbitmqBroker",
        "OPTIONS": {"url": BROKER_URL},
        "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
    }
elif BROKER_URL:
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq.brokers.redis.RedisBroker",
        "OPTIONS": {"url": BROKER_URL, "namespace": env_str("HEARTH_BROKER_NAMESPACE", "dramatiq")},
        "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
    }
else:
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq.brokers.stub.StubBroker",
        "OPTIONS": {},
        "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
    }
DRAMATIQ_AUTODISCOVER_MODULES = ["tasks"]
