"""Settings for the test run: Hearth's own, on the real PostgreSQL (HEARTH_TEST_DATABASE_URL)."""

import os

from controlplane.settings import *  # noqa: F403
from controlplane.settings import database_from_url

DATABASES = {
    "default": database_from_url(
        os.environ.get("HEARTH_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/hearth")
    )
}
