"""The tables every job writes (jobs, events, the usage ledger) carry no index that another one
already serves: a job's row is written three times (queued, running, settled) and each write
updates every index, since its status is indexed."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from controlplane.pattern_indexes import DropPatternIndexes

pytestmark = pytest.mark.django_db

HOT_TABLES = ("jobs_job", "events_event", "billing_usagerecord")


def index_columns(table: str) -> dict[str, str]:
    """Each index of `table`: its name → its definition's column list."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [table])
        return {name: definition.split(" USING btree ", 1)[1] for name, definition in cursor}


@pytest.mark.parametrize("table", HOT_TABLES)
def test_no_like_pattern_index_on_a_hot_table(table):
    patterns = {n: d for n, d in index_columns(table).items() if "pattern_ops" in d}
    assert patterns == {}


def test_the_jobs_table_keeps_the_indexes_its_queries_use_and_no_duplicate():
    columns = sorted(index_columns("jobs_job").values())
    assert columns == sorted(
        [
            "(id)",
            "(request_id)",
            "(api_key_id)",
            "(batch_id)",
            "(org_id, created DESC, id DESC)",
            "(status, model, created)",
            "(org_id, finished_at) INCLUDE (ttft_s, tpot_s, queue_wait_s)"
            " WHERE (finished_at IS NOT NULL)",
        ]
    )


def test_the_events_and_usage_tables_keep_only_their_composite_and_unique_indexes():
    assert sorted(index_columns("events_event").values()) == sorted(
        ["(sequence)", "(id)", "(org_id, sequence)", "(created) WHERE fan_out_pending"]
    )
    assert sorted(index_columns("billing_usagerecord").values()) == sorted(
        ["(id)", "(request_id)", "(api_key_id)", "(price_id)", "(org_id, created)"]
    )


def test_dropping_the_pattern_indexes_is_reversible():
    state = MigrationLoader(connection).project_state(("jobs", "0008_lean_indexes"))
    operation = DropPatternIndexes(model_name="job", fields=["id", "request_id", "batch"])
    with connection.schema_editor() as editor:  # inside the test's transaction: rolled back
        operation.database_backwards("jobs", editor, state, state)
    restored = [d for d in index_columns("jobs_job").values() if "pattern_ops" in d]
    assert sorted(restored) == sorted(
        [
            "(id varchar_pattern_ops)",
            "(request_id varchar_pattern_ops)",
            "(batch_id varchar_pattern_ops)",
        ]
    )
    with connection.schema_editor() as editor:
        operation.database_forwards("jobs", editor, state, state)
    assert not [d for d in index_columns("jobs_job").values() if "pattern_ops" in d]
