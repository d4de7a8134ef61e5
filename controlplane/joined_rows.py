"""Model instances from a hand-written join's raw rows, loaded as the ORM would load them.

The start's claim and the settlement's lock read a job with its org (and price) in one
statement the ORM cannot write; this turns each row back into instances.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from django.db import connection, connections


def instances_from_row(row, models_in_row) -> list[Any]:
    """One loaded instance per model of a raw row that holds each model's concrete columns in
    turn (a hand-written join); None for a model whose columns are all NULL (an outer join
    that found nothing)."""
    instances = []
    for model in models_in_row:
        fields = model._meta.concrete_fields
        values, row = row[: len(fields)], row[len(fields) :]
        if all(value is None for value in values):
            instances.append(None)
            continue
        names, converters = _loading(connections[connection.alias], model)
        instances.append(model.from_db(connection.alias, names, _from_db(converters, values)))
    return instances


@lru_cache(maxsize=64)
def _loading(wrapper, model) -> tuple[list[str], list[tuple[Any, list]]]:
    """The attribute names of `model`'s concrete fields, and each column with the converters
    the ORM applies when it loads a row through `wrapper` (a thread's connection, not the
    thread-local proxy): JSON parsed, and so on. Found once per connection and model: working
    them out for every row was a large share of the worker's CPU (docs/performance.md)."""
    fields = model._meta.concrete_fields
    converters = []
    for field in fields:
        column = field.get_col(model._meta.db_table)
        converts = wrapper.ops.get_db_converters(column)
        converters.append((column, converts + column.get_db_converters(wrapper)))
    return [f.attname for f in fields], converters


def _from_db(converters, row) -> list[Any]:
    """A raw row's values as the ORM would load them."""
    values = []
    for (column, converts), value in zip(converters, row, strict=True):
        for convert in converts:
            value = convert(value, column, connection)
        values.append(value)
    return values
