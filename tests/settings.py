"""Settings for the test run: Hearth's own, on the real PostgreSQL (HEARTH_TEST_DATABASE_URL)."""

import os

from controlplane.settings import *  # noqa: F403
from controlplane.settings import _DRAMATIQ_MIDDLEWARE, database_from_url

DATABASES = {
    "default": database_from_url(
        os.environ.get("HEARTH_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/hearth")
    )
}

# The real Redis broker, in a namespace of this test run's own.
TEST_BROKER_NAMESPACE = f"hearth-test-{os.getpid()}"
DRAMATIQ_BROKER = {
    "BROKER": "inference.protocol.keyed_messages.KeyedRedisBroker",
    "OPTIONS": {
        "url": os.environ.get("HEARTH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "namespace": TEST_BROKER_NAMESPACE,
    },
    "MIDDLEWARE": _DRAMATIQ_MIDDLEWARE,
}
