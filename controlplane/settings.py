"""Hearth's Django settings: one module, configured from the environment.

With no `DATABASE_URL` Hearth runs embedded on SQLite under `HEARTH_DATA_DIR`; with
`DATABASE_URL=postgres://…` it uses PostgreSQL through psycopg 3 (docs/architecture.md).
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


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


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
        # A new connection is slow to open, so connections are kept. Under ASGI Django closes
        # a thread's connection only where request signals fire; every place that touches the
        # ORM off those threads (the gateway's admission, the consumers, the worker's
        # middleware) calls close_old_connections itself, which keeps a healthy connection for
        # CONN_MAX_AGE and replaces a broken one. That measured cheaper than psycopg's pool on
        # the admission path (docs/performance.md); HEARTH_DB_POOL=1 chooses the pool.
        "CONN_MAX_AGE": 0 if env_bool("HEARTH_DB_POOL") else env_int("HEARTH_DB_CONN_MAX_AGE", 60),
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": {"pool": {"min_size": 1, "max_size": env_int("HEARTH_DB_POOL_SIZE", 20)}}
        if env_bool("HEARTH_DB_POOL")
        else {},
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
    "django.contrib.staticfiles",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework",
    "drf_spectacular",
    "django_dramatiq",
    "controlplane.accounts",
    "controlplane.catalog",
    "controlplane.billing",
    "controlplane.jobs",
    "controlplane.gateway",
    "controlplane.events",
    "controlplane.console",
    "channels",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# The API authenticates by Bearer key and keeps no session: under ASGI it runs without the
# console's middleware (controlplane/asgi.py explains the cost).
API_MIDDLEWARE: list[str] = []

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
            # The gateway, the in-process worker and the node share one file: wait for locks
            # instead of failing, take the write lock up front, and let readers run beside a
            # writer (WAL).
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
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
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.template.context_processors.csrf",
            ]
        },
    }
]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["controlplane.api.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "controlplane.api.exception_handler.openai_exception_handler",
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# `GET /openapi.json` (controlplane/openapi): drf-spectacular introspects the DRF views; the hook
# adds the async views and every operation's bodies and errors. OpenAPI 3.1, as OpenAI's own
# spec, whose schemas it reuses.
SPECTACULAR_SETTINGS = {
    "TITLE": "Hearth",
    "DESCRIPTION": "A self-hosted, OpenAI-compatible inference platform: OpenAI's API with "
    "Hearth's extensions (jobs, events, webhooks, usage and billing).",
    "VERSION": "1",
    "OAS_VERSION": "3.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": ["controlplane.openapi.hooks.describe_api"],
    # The DRF views have no serializers to introspect: the hook describes their bodies.
    "DISABLE_ERRORS_AND_WARNINGS": True,
}
# `check --deploy` generates the schema once more and reports those same views as errors
# (drf_spectacular.W002); its E001, a schema that fails to generate, still counts.
# models.W040: SQLite (embedded mode) ignores an index's INCLUDE columns; the index still serves
# there, and PostgreSQL keeps the covering form (job_org_finished, for the dashboard).
SILENCED_SYSTEM_CHECKS = ["drf_spectacular.W002", "models.W040"]

LOGIN_URL = "/console/login"
LOGIN_REDIRECT_URL = "/console/"
LOGOUT_REDIRECT_URL = "/console/login"
CSRF_TRUSTED_ORIGINS = [
    o for o in env_str("HEARTH_CSRF_TRUSTED_ORIGINS", "http://127.0.0.1:8000").split(",") if o
]
# HTTPS (docs/deploy.md). Production sits behind a proxy that terminates TLS and says so with
# X-Forwarded-Proto, which uvicorn believes from the addresses in FORWARDED_ALLOW_IPS. These act
# where Django's middleware runs (the console, /metrics, /openapi.json); the API (`/v1/…`) runs
# without it (asgi.py), so the proxy redirects and sends HSTS for it. Off by default: embedded
# mode and the tests serve plain HTTP on loopback.
SECURE_SSL_REDIRECT = env_bool("HEARTH_SECURE_SSL_REDIRECT", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("HEARTH_SECURE_COOKIES", False)
SECURE_HSTS_SECONDS = env_int("HEARTH_SECURE_HSTS_SECONDS", 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("HEARTH_SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("HEARTH_SECURE_HSTS_PRELOAD", False)

STATIC_URL = "/static/"
STATIC_ROOT = DATA_DIR / "static"

# Dramatiq: Redis (or RabbitMQ with BROKER_URL=amqp://…) in production, the in-process StubBroker
# in embedded mode. Nodes use the same broker and namespace (`python -m inference.node`).
REDIS_URL = env_str("REDIS_URL")
# Embedded mode (no REDIS_URL): one process runs gateway, worker and node (controlplane/embedded).
EMBEDDED = not REDIS_URL
BROKER_URL = env_str("BROKER_URL") or REDIS_URL
_DRAMATIQ_MIDDLEWARE = [
    "dramatiq.middleware.AgeLimit",
    "dramatiq.middleware.TimeLimit",
    "dramatiq.middleware.Callbacks",
    "dramatiq.middleware.Retries",
    "django_dramatiq.middleware.DbConnectionsMiddleware",
]
# With the Redis broker, how long a consumer (a node, a worker) may go without a heartbeat before
# the others requeue the messages it had taken: a dead node's requests go to another node after
# this. RabbitMQ requeues at once when the connection drops.
BROKER_HEARTBEAT_TIMEOUT_MS = env_int("HEARTH_BROKER_HEARTBEAT_TIMEOUT_MS", 60_000)
# The requeue runs as part of a fetch, on this many fetches out of a million. Dramatiq's default
# (1,000) means an idle worker, fetching about once a second, requeues a dead one's messages after
# about a quarter of an hour; at 100,000 it is seconds. It rides along with the fetch's script.
BROKER_MAINTENANCE_CHANCE = env_int("HEARTH_BROKER_MAINTENANCE_CHANCE", 100_000)
# Where the rate limits' buckets live in Redis (controlplane/dispatch/ratelimiting.py).
RATE_LIMIT_PREFIX = f"{env_str('HEARTH_BROKER_NAMESPACE', 'dramatiq')}:ratelimit:"
if BROKER_URL.startswith("amqp"):
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq.brokers.rabbitmq.RabbitmqBroker",
        "OPTIONS": {"url": BROKER_URL},
        "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
    }
elif BROKER_URL:
    DRAMATIQ_BROKER = {
        "BROKER": "inference.protocol.keyed_messages.KeyedRedisBroker",
        "OPTIONS": {
            "url": BROKER_URL,
            "namespace": env_str("HEARTH_BROKER_NAMESPACE", "dramatiq"),
            "heartbeat_timeout": BROKER_HEARTBEAT_TIMEOUT_MS,
            "maintenance_chance": BROKER_MAINTENANCE_CHANCE,
        },
        "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
    }
else:
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq.brokers.stub.StubBroker",
        "OPTIONS": {},
        "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
    }
DRAMATIQ_AUTODISCOVER_MODULES = ["tasks"]

# Channels: token deltas and event pushes. The node builds its own RedisChannelLayer with the same
# prefix (`runnode` passes it). redis-py 8 times out channels_redis's 5 s BRPOP at its default
# socket timeout, so the socket waits longer than the poll.
CHANNEL_PREFIX = env_str("HEARTH_CHANNEL_PREFIX", "asgi")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
                "prefix": CHANNEL_PREFIX,
                # Checked by the sender, per receiving process: a gateway's streams share it.
                "capacity": 10_000,
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# How long a synchronous request waits for its answer, queue time included.
SYNC_REQUEST_TIMEOUT_S = env_float("HEARTH_SYNC_REQUEST_TIMEOUT_S", 600.0)
# Concurrent admissions of a gateway process write their jobs in shared transactions
# (controlplane/dispatch/group_commit.py); off, each writes its own.
ADMISSION_GROUP_COMMIT = env_bool("HEARTH_GROUP_COMMIT", True)
# Threads of a gateway process that run admissions (controlplane/gateway/completions.py).
ADMISSION_THREADS = env_int("HEARTH_ADMISSION_THREADS", 16)
# A queued job's deadline when its request names none (`deadline_s`): after it, it is expired.
JOB_DEADLINE_S = env_int("HEARTH_JOB_DEADLINE_S", 24 * 3600)
# How many times a job may start on a node before it is failed instead of tried again (a request
# that kills its node every time must not loop).
JOB_MAX_ATTEMPTS = env_int("HEARTH_JOB_MAX_ATTEMPTS", 3)
# How long a job must have been in the broker before `sweepjobs` may find it lost with the broker
# (controlplane/dispatch/redelivery.py): longer than admission takes from its row to its enqueue.
JOB_REDELIVERY_GRACE_S = env_float("HEARTH_JOB_REDELIVERY_GRACE_S", 30.0)
# Files (controlplane/jobs/files.py): the largest upload, in bytes (a larger one is a 400), and
# the most requests one batch input file may hold.
FILES_MAX_BYTES = env_int("HEARTH_FILES_MAX_BYTES", 50 * 1024 * 1024)
BATCH_MAX_LINES = env_int("HEARTH_BATCH_MAX_LINES", 50_000)
# Batches send all their lines for a model to one node when at least half the neighbouring
# (sorted) prompts share this many tokens (one KV block: less never hits the prefix cache) and
# the batch has at least this many lines (controlplane/dispatch/batches.py, `wants_one_node`).
BATCH_AFFINITY_PREFIX_TOKENS = env_int("HEARTH_BATCH_AFFINITY_PREFIX_TOKENS", 16)
BATCH_AFFINITY_MIN_LINES = env_int("HEARTH_BATCH_AFFINITY_MIN_LINES", 4)
# Webhooks (controlplane/events/webhooks.py). Endpoints whose host resolves to a private,
# loopback, link-local, multicast or reserved address are refused unless this is on: a laptop or
# a deployment whose receivers sit on the same private network.
WEBHOOK_ALLOW_PRIVATE = env_bool("HEARTH_WEBHOOK_ALLOW_PRIVATE", False)
# One delivery attempt's socket timeout (connect, and each read), in seconds.
WEBHOOK_TIMEOUT_S = env_float("HEARTH_WEBHOOK_TIMEOUT_S", 10.0)
# A `sending` attempt older than the timeout plus this belongs to a worker that died mid-request:
# a redelivered message may claim it again. Longer than any pause a live worker takes.
WEBHOOK_CLAIM_LEASE_MARGIN_S = env_float("HEARTH_WEBHOOK_CLAIM_LEASE_MARGIN_S", 60.0)
# Attempts per event and endpoint, the first included.
WEBHOOK_MAX_ATTEMPTS = env_int("HEARTH_WEBHOOK_MAX_ATTEMPTS", 8)
# The upper bound of the wait after the 1st, 2nd, … failed attempt (the last repeats); the wait
# is drawn uniformly below it (full jitter). Default 5 s, 30 s, 2 min, 10 min, 1 h, 6 h.
WEBHOOK_RETRY_SCHEDULE_S = [
    float(step)
    for step in env_str("HEARTH_WEBHOOK_RETRY_SCHEDULE_S", "5,30,120,600,3600,21600").split(",")
]
# How often the gateway re-reads the node registry (heartbeats), in seconds.
NODE_REGISTRY_TTL_S = env_float("HEARTH_NODE_REGISTRY_TTL_S", 0.5)
# A node silent this long is dead: the sweeper sends its queued and running jobs elsewhere
# (dispatch/redelivery.py). Well above a heartbeat's TTL (6 s), which a long step can outlast.
NODE_DEAD_AFTER_S = env_float("HEARTH_NODE_DEAD_AFTER_S", 30.0)
# `GET /metrics` asks for `Authorization: Bearer <this>` when it is set (Prometheus's
# `authorization` setting sends it); unset, it is open, for a scraper on the private network.
METRICS_TOKEN = env_str("HEARTH_METRICS_TOKEN")
# Routing (controlplane/dispatch/routing.py): a node whose load (the larger of its sequence slots
# and its KV blocks in use) is at or above this fraction is busy: sessions leave it and prefix
# matches on it lose to a less loaded node. How long a session keeps its node after its last
# request, and how long the gateway remembers where it sent a prompt (until the node's heartbeat
# shows the prompt's blocks), in seconds.
ROUTING_MAX_LOAD = env_float("HEARTH_ROUTING_MAX_LOAD", 0.9)
ROUTING_SESSION_TTL_S = env_float("HEARTH_ROUTING_SESSION_TTL_S", 3600.0)
ROUTING_PREFIX_TTL_S = env_float("HEARTH_ROUTING_PREFIX_TTL_S", 120.0)
# Disaggregated prefill (controlplane/dispatch/disaggregation.py): a request goes to a prefill
# node only when at least this many of its prompt tokens are not expected in its decode node's
# prefix cache (a shorter prefill costs the decode node less than the transfer costs), and only
# to a prefill node holding fewer than this many prompt tokens not yet computed (else it is
# saturated, and the decode node prefills itself).
DISAGG_MIN_TOKENS = env_int("HEARTH_DISAGG_MIN_TOKENS", 512)
DISAGG_MAX_QUEUED_TOKENS = env_int("HEARTH_DISAGG_MAX_QUEUED_TOKENS", 16384)

# The log's format (inference/protocol/logs.py): `json`, one object a line with the ids of the
# request being handled (request, job, org, node: docs/observability.md), or `text`. JSON by
# default in production, where a log collector reads it; text in embedded mode, on a terminal.
LOG_FORMAT = env_str("HEARTH_LOG_FORMAT", "text" if EMBEDDED else "json")
if LOG_FORMAT not in ("json", "text"):
    raise ValueError(f"HEARTH_LOG_FORMAT must be json or text, not {LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "inference.protocol.logs.JsonFormatter"},
        "text": {"()": "inference.protocol.logs.TextFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env_str("HEARTH_LOG_LEVEL", "WARNING")},
    # Hearth's own at INFO: a node under `runnode` logs its start, drain and aborts there.
    "loggers": {
        "controlplane": {"level": env_str("HEARTH_LOG_LEVEL", "INFO")},
        "inference": {"level": env_str("HEARTH_LOG_LEVEL", "INFO")},
    },
}
