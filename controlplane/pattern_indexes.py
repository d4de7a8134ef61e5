"""A migration operation that drops the `varchar_pattern_ops` indexes Django adds on PostgreSQL.

For every indexed or unique `CharField` (primary keys and foreign keys to them included),
Django's PostgreSQL backend creates a second index, `<table>_<column>_<hash>_like`, which serves
only `LIKE 'prefix%'` queries outside the C locale. Hearth never looks up an id, a request id or
a foreign key by pattern, so these indexes are pure write cost: every INSERT, and every UPDATE
that changes an indexed column (a job's status does, three times in its life), writes each of
them (bench/job_queue.py, docs/performance.md). Django keeps no migration state for them, so
dropping them changes no state; an AlterField of such a field later would create its index again.
"""

from __future__ import annotations

from django.db import migrations


class DropPatternIndexes(migrations.operations.base.Operation):
    """Drop the `_like` indexes of `fields` of `model_name` (PostgreSQL only; elsewhere, and on
    SQLite, there are none). Reversible: going back creates them as Django would."""

    reversible = True
    reduces_to_sql = True

    def __init__(self, model_name: str, fields: list[str]) -> None:
        self.model_name = model_name
        self.fields = fields

    def deconstruct(self):
        return (self.__class__.__name__, [], {"model_name": self.model_name, "fields": self.fields})

    def state_forwards(self, app_label, state) -> None:
        pass  # Django's state never held these indexes

    def _targets(self, app_label, state):
        model = state.apps.get_model(app_label, self.model_name)
        return model, [model._meta.get_field(name) for name in self.fields]

    def database_forwards(self, app_label, schema_editor, from_state, to_state) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        model, fields = self._targets(app_label, to_state)
        for field in fields:
            name = schema_editor._create_index_name(
                model._meta.db_table, [field.column], suffix="_like"
            )
            schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(name)}")

    def database_backwards(self, app_label, schema_editor, from_state, to_state) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        model, fields = self._targets(app_label, to_state)
        for field in fields:
            statement = schema_editor._create_like_index_sql(model, field)
            if statement is not None:
                schema_editor.execute(statement)

    def describe(self) -> str:
        return f"Drop the LIKE-pattern indexes of {self.model_name}.{', '.join(self.fields)}"
