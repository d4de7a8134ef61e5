"""Many rows in one statement whose text does not depend on how many there are (PostgreSQL).

The hot paths write groups of rows: the jobs a gateway's writer commits together, the events of
a group, the usage rows and job updates of a settled group. Written as `VALUES (%s, …), (%s, …)`,
a statement's text and parameter count grow with the group. psycopg caches the parsing of a
query's placeholders only for queries under 50 parameters and 4 KB of text; a larger one is
parsed again, in Python, at every call, and each parameter quoted on the client: a large share of
the worker's and the gateway's CPU (docs/performance.md). Here the rows
travel as one JSON document, a single parameter, that PostgreSQL expands with
`jsonb_populate_recordset(NULL::<table>, …)`, which types each column as the table does; the
statement's text is the same for one row or sixty, so psycopg parses it once per process.
"""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections
from psycopg.types.json import Jsonb

_AS_THEY_ARE = (str, int, bool)


def column_value(field, value: Any, wrapper=None) -> Any:
    """`value` of `field` as a JSON value that PostgreSQL reads back as the column's type: the
    database form the ORM would send (`get_db_prep_save`, through `wrapper`, the thread's
    connection), with JSON columns nested as JSON, times in ISO 8601 with their offsets and
    decimals as exact strings. A string, an integer, a boolean or None is already that, and is
    taken as it is: the ORM's preparation of each column made writing a group expensive."""
    if value is None or type(value) in _AS_THEY_ARE:
        return value
    prepared = field.get_db_prep_save(value, wrapper or connections[DEFAULT_DB_ALIAS])
    if isinstance(prepared, Jsonb):
        return prepared.obj
    if isinstance(prepared, datetime.datetime | datetime.date):
        return prepared.isoformat()
    if isinstance(prepared, decimal.Decimal | uuid.UUID):
        return str(prepared)
    if prepared is None or isinstance(prepared, str | int | float | bool):
        return prepared
    raise TypeError(f"{field} has a value JSON cannot carry: {type(prepared).__name__}")


def row_values(obj, fields: list, adding: bool = False) -> dict[str, Any]:
    """`obj`'s `fields` as column name → JSON value; `adding` runs each field's `pre_save` first,
    as the ORM's INSERT does (an auto_now_add time is set then)."""
    wrapper = connections[DEFAULT_DB_ALIAS]
    if adding:
        return {f.column: column_value(f, f.pre_save(obj, True), wrapper) for f in fields}
    return {f.column: column_value(f, f.value_from_object(obj), wrapper) for f in fields}


def document(rows: list[dict[str, Any]]) -> str:
    """The rows (column name → JSON value) as the statement's one parameter."""
    return json.dumps(rows, separators=(",", ":"))


def expand(table: str, alias: str = "r") -> str:
    """The FROM item that turns the `%s` document back into rows of `table`'s row type, in the
    document's order (`ORDER BY <alias>.ordinality` keeps it, for sequences assigned in it)."""
    quoted = connection.ops.quote_name(table)
    return f"jsonb_populate_recordset(NULL::{quoted}, %s::jsonb) WITH ORDINALITY {alias}"


def insert(model, fields: list, objs: list) -> tuple[str, list[Any]]:
    """The INSERT of unsaved `objs` of `model`, `fields` only (the database fills the rest), in
    their order, as (sql, params); each field's `pre_save` runs first, as the ORM's INSERT runs
    it (`created` is set here)."""
    table = model._meta.db_table
    rows = [row_values(obj, fields, adding=True) for obj in objs]
    columns = ", ".join(f'"{f.column}"' for f in fields)
    selected = ", ".join(f'r."{f.column}"' for f in fields)
    return (
        f"INSERT INTO {connection.ops.quote_name(table)} ({columns}) SELECT {selected} "
        f"FROM {expand(table)} "
        "ORDER BY r.ordinality",
        [document(rows)],
    )


def update(model, fields: list, objs: list) -> tuple[str, list[Any]]:
    """The UPDATE of `fields` of loaded `objs` of `model`, each by its primary key, as one
    statement (sql, params)."""
    table, pk = model._meta.db_table, model._meta.pk
    rows = [row_values(obj, [pk, *fields]) for obj in objs]
    assignments = ", ".join(f'"{f.column}" = r."{f.column}"' for f in fields)
    return (
        f"UPDATE {connection.ops.quote_name(table)} t SET {assignments} FROM {expand(table)} "
        f'WHERE t."{pk.column}" = r."{pk.column}"',
        [document(rows)],
    )
