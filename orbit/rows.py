"""Row locks and counter increments as plain SQL, for the statements every
transaction runs.

Locking a row by primary key and adding to a counter are the statements the
submit, round and lease transactions issue most, while holding the locks
everyone else waits for. Built by the ORM each costs ~3.5x what the same SQL
costs sent as is (measured on MariaDB: ~345 vs ~100 µs); the rows are still
read into model instances, with the ORM's own converters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from django.db import connection, models

M = TypeVar("M", bound=models.Model)


def _quoted(model: type[models.Model]) -> tuple[str, str]:
    quote = connection.ops.quote_name
    return quote(model._meta.db_table), quote(model._meta.pk.column)


def lock_by_pk(model: type[M], pks: Iterable[str]) -> dict[str, M]:
    """SELECT … WHERE pk IN (…) ORDER BY pk FOR UPDATE: the rows that exist, by pk,
    locked in ascending key order (FOR UPDATE only where the database has it)."""
    wanted = sorted(set(pks))
    if not wanted:
        return {}
    table, pk = _quoted(model)
    sql = f"SELECT * FROM {table} WHERE {pk} IN ({', '.join(['%s'] * len(wanted))}) ORDER BY {pk}"
    if connection.features.has_select_for_update:
        sql += " FOR UPDATE"
    return {row.pk: row for row in model.objects.raw(sql, wanted)}


def add_to_row(model: type[models.Model], pk: str, increments: dict[str, int]) -> None:
    """UPDATE … SET column = column + n, … WHERE pk = %s (columns named as fields)."""
    if not increments:
        return
    quote = connection.ops.quote_name
    table, pk_column = _quoted(model)
    columns = [model._meta.get_field(name).column for name in increments]
    sets = ", ".join(f"{quote(column)} = {quote(column)} + %s" for column in columns)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {sets} WHERE {pk_column} = %s", [*increments.values(), pk])


def set_each(
    model: type[models.Model], *, match: str, values: dict[Any, Any], field: str, where: dict[str, Any], **same: Any
) -> None:
    """One UPDATE giving each row (picked by its `match` value, among the rows
    equal to `where`) its own value of `field`, and `same` to all of them:
    SET field = CASE match WHEN … THEN … END. bulk_update issues the same
    statement, but builds it through ORM expressions row by row."""
    if not values:
        return
    quote = connection.ops.quote_name
    table, _ = _quoted(model)
    meta = model._meta
    target, matched = meta.get_field(field), quote(meta.get_field(match).column)
    params: list[Any] = []
    for key, value in values.items():
        params += [key, target.get_db_prep_save(value, connection)]
    sets = [f"{quote(target.column)} = CASE {matched} {' '.join(['WHEN %s THEN %s'] * len(values))} END"]
    for name, value in same.items():
        column = meta.get_field(name)
        sets.append(f"{quote(column.column)} = %s")
        params.append(column.get_db_prep_save(value, connection))
    conditions = [f"{quote(meta.get_field(name).column)} = %s" for name in where]
    params += list(where.values())
    conditions.append(f"{matched} IN ({', '.join(['%s'] * len(values))})")
    params += list(values)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {', '.join(sets)} WHERE {' AND '.join(conditions)}", params)
