"""The statements every transaction runs, as plain SQL.

Locking rows by primary key, reading them, updating and inserting them are
what the submit, round and lease transactions issue most, while holding the
locks everyone else waits for. Built by the ORM each costs several times what
the same SQL costs sent as is (measured on MariaDB: ~345 vs ~100 µs to lock a
row; a round of 16 tasks spent over half its time compiling queries and
building model instances). The statements are the ones the ORM would send;
rows are still read into model instances with the ORM's own converters, and
values written with each field's own get_db_prep_save."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, TypeGuard, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, connections, models, transaction
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.models import Model
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from django.utils import timezone

M = TypeVar("M", bound=models.Model)
F = TypeVar("F", bound=models.Field)
# A row's primary key: the models' string ids, or an integer (WorkerIdentity's).
Pk = str | int


@dataclass(frozen=True)
class Add:
    """An update value meaning column = column + amount."""

    amount: int


@dataclass(frozen=True)
class _Shape:
    table: str
    pk: str
    columns: str  # the SELECT list: every concrete field in model order, or the ones asked for
    attnames: tuple[str, ...]
    # (field index, its column expression, its converters), for fields that have any
    converters: tuple[tuple[int, Any, tuple[Callable[..., Any], ...]], ...]


def _db() -> Any:
    """This thread's database wrapper, looked up once per statement: each
    access through django.db.connection repeats the lookup."""
    return connections[DEFAULT_DB_ALIAS]


def _shape(model: type[models.Model], db: Any) -> _Shape:
    return _shape_for(model, db.vendor)


def _is_make_aware(db: Any, convert: Any) -> bool:
    return db.vendor == "mysql" and getattr(convert, "__func__", None) is type(db.ops).convert_datetimefield_value


def _made_aware(db: Any) -> Callable[[Any, Any, Any], Any]:
    """MySQL's DATETIME converter (timezone.make_aware in the connection's
    time zone) without make_aware's check that the value is naive, which is
    half its cost: the driver only ever returns naive datetimes."""
    zone = db.timezone

    def convert(value: Any, expression: Any, connection: Any) -> Any:
        return value if value is None else value.replace(tzinfo=zone)

    return convert


@cache
def _shape_for(model: type[models.Model], vendor: str, only: tuple[str, ...] = ()) -> _Shape:
    # Keyed by vendor, not by wrapper: every thread has a wrapper of its own.
    db = _db()
    quote = db.ops.quote_name
    fields = [field for field in model._meta.concrete_fields if not only or field.attname in only]
    converters = []
    for index, field in enumerate(fields):
        column = field.cached_col
        found = tuple(
            _made_aware(db) if _is_make_aware(db, convert) else convert
            for convert in (*db.ops.get_db_converters(column), *column.get_db_converters(db))
        )
        if found:
            converters.append((index, column, found))
    return _Shape(
        table=quote(model._meta.db_table),
        pk=quote(model._meta.pk.column),
        columns=", ".join(quote(field.column) for field in fields),
        attnames=tuple(field.attname for field in fields),
        converters=tuple(converters),
    )


def _instances(db: Any, model: type[M], shape: _Shape, rows: Iterable[Sequence[Any]]) -> list[M]:
    """Model.from_db for rows of every concrete field, minus Model.__init__'s
    per-field work, which only matters to post_init receivers (a model with
    any is built by from_db)."""
    plain = not post_init.has_listeners(model)
    built = []
    for row in rows:
        values = list(row)
        for index, column, converters in shape.converters:
            value = values[index]
            for convert in converters:
                value = convert(value, column, db)
            values[index] = value
        if not plain:
            # Django reads field_names only when values are fewer than the concrete fields.
            built.append(model.from_db(db.alias, None, values))  # type: ignore[arg-type]
            continue
        instance = model.__new__(model)
        instance.__dict__.update(zip(shape.attnames, values, strict=True))
        state = instance._state = ModelState()
        state.adding, state.db = False, db.alias
        built.append(instance)
    return built


@dataclass(frozen=True)
class _Defaults:
    """A model's field defaults for new rows: every attname (in field order)
    with its default where that is one value for every row, and the fields
    whose default is made per row (a callable, or a database default)."""

    template: dict[str, Any]
    made: tuple[tuple[str, Callable[[], Any]], ...]


@cache
def _new_row_defaults(model: type[models.Model]) -> _Defaults:
    template: dict[str, Any] = {}
    made = []
    for field in model._meta.concrete_fields:
        if field.generated:  # the database's to compute, never inserted
            continue
        per_row = callable(field.default) if field.has_default() else field.db_default is not models.NOT_PROVIDED
        # get_default gives a non-callable default itself, and None or "" for a field without one
        template[field.attname] = None if per_row else field.get_default()
        if per_row:
            made.append((field.attname, field.get_default))
    return _Defaults(template, tuple(made))


def new_row(model: type[M], **values: Any) -> M:
    """model(**values) for a row about to be inserted (insert_rows): every
    concrete field from `values` (by attname) or its default, minus
    Model.__init__'s generic keyword handling and its pre_init/post_init
    signals (a model with receivers of either, or a value given by another
    name, is built by Model.__init__)."""
    defaults = _new_row_defaults(model)
    if pre_init.has_listeners(model) or post_init.has_listeners(model) or not values.keys() <= defaults.template.keys():
        return model(**values)
    instance = model.__new__(model)
    instance._state = ModelState()
    row = instance.__dict__
    row.update(defaults.template)
    for attname, make in defaults.made:
        if attname not in values:
            row[attname] = make()
    row.update(values)
    return instance


def select_rows(
    model: type[M], where: str, params: Sequence[Any], *, lock: bool = False, skip_locked: bool = False
) -> list[M]:
    """SELECT every column … WHERE `where` (SQL over the model's columns, may
    end in ORDER BY / LIMIT), as model instances; FOR UPDATE [SKIP LOCKED]
    with `lock` where the database has it."""
    db = _db()
    return _select(db, model, _shape(model, db), where, params, lock=lock, skip_locked=skip_locked)


def _select(
    db: Any, model: type[M], shape: _Shape, where: str, params: Sequence[Any], *, lock: bool, skip_locked: bool
) -> list[M]:
    sql = f"SELECT {shape.columns} FROM {shape.table} WHERE {where}"
    if lock and db.features.has_select_for_update:
        sql += " FOR UPDATE SKIP LOCKED" if skip_locked else " FOR UPDATE"
    with db.cursor() as cursor:
        cursor.execute(sql, params)
        return _instances(db, model, shape, cursor.fetchall())


def pk_in(model: type[models.Model], pks: Iterable[Pk]) -> tuple[str, list[Pk]]:
    """WHERE pk IN (…) ORDER BY pk, and its parameters (the distinct pks, ascending)."""
    return _pk_in(_shape(model, _db()), pks)


def _pk_in(shape: _Shape, pks: Iterable[Pk]) -> tuple[str, list[Pk]]:
    wanted = sorted(set(pks))
    return f"{shape.pk} IN ({', '.join(['%s'] * len(wanted))}) ORDER BY {shape.pk}", wanted


def namespace_keys_in(namespace_id: str, keys: Iterable[str]) -> tuple[str, list[str]]:
    """WHERE namespace_id = %s AND key IN (…), for the rows a namespace keys by
    `key` (at least one key), and its parameters (the distinct keys ascending)."""
    wanted = sorted(set(keys))
    key = _db().ops.quote_name("key")
    return f"namespace_id = %s AND {key} IN ({', '.join(['%s'] * len(wanted))})", [namespace_id, *wanted]


def select_together(
    queries: Sequence[tuple[type[models.Model], str, Sequence[Any]]], *, lock: bool = False
) -> list[list[Any]]:
    """Several select_rows in one round trip (a multi-statement query) on
    MySQL/MariaDB, one after another elsewhere: the rows of each, in order;
    each FOR UPDATE with `lock`, its locks taken in the order given."""
    db = _db()
    if db.vendor != "mysql" or len(queries) < 2:
        return [select_rows(model, where, params, lock=lock) for model, where, params in queries]
    shapes = [_shape(model, db) for model, _, _ in queries]
    suffix = " FOR UPDATE" if lock else ""
    statements = [
        f"SELECT {shape.columns} FROM {shape.table} WHERE {where}{suffix}"
        for shape, (_, where, _) in zip(shapes, queries, strict=True)
    ]
    rows = _rows_together(db, statements, [param for _, _, params in queries for param in params])
    return [
        _instances(db, model, shape, found) for shape, (model, _, _), found in zip(shapes, queries, rows, strict=True)
    ]


def _rows_together(db: Any, statements: list[str], params: list[Any]) -> list[list[Any]]:
    """The rows of each statement, sent as one multi-statement query."""
    found: list[list[Any]] = []
    with db.cursor() as cursor:
        cursor.execute("; ".join(statements), params)
        for index in range(len(statements)):
            if index:
                with db.wrap_database_errors:
                    cursor.cursor.nextset()
            found.append(list(cursor.fetchall()))
    return found


def select_ids_together(model: type[models.Model], queries: Sequence[tuple[str, Sequence[Any]]]) -> list[list[Any]]:
    """The primary keys of several `SELECT pk … WHERE where` (no lock), in
    one round trip on MySQL/MariaDB, one after another elsewhere: the pks of
    each, in order."""
    db = _db()
    shape = _shape(model, db)
    statements = [f"SELECT {shape.pk} FROM {shape.table} WHERE {where}" for where, _ in queries]
    if db.vendor == "mysql" and len(queries) > 1:
        rows = _rows_together(db, statements, [param for _, params in queries for param in params])
    else:
        rows = []
        with db.cursor() as cursor:
            for sql, (_, params) in zip(statements, queries, strict=True):
                cursor.execute(sql, params)
                rows.append(list(cursor.fetchall()))
    return [[row[0] for row in found] for found in rows]


_held = threading.local()


@dataclass
class _Holding:
    models: tuple[type[Model], ...]  # the field's name hides the module: Model is imported
    rows: dict[tuple[type[Model], Any], Any]
    changed: dict[tuple[type[Model], Any], set[str]]  # field names written since the lock


@contextmanager
def holding(*held_models: type[models.Model]) -> Iterator[None]:
    """Inside one transaction: rows of `held_models` that lock_by_pk locks are
    kept for the block. Locking one again returns the kept row without a
    statement, and update_by_pk on kept rows changes them in memory; each
    changed row is written once, with its final values, when the block ends
    (not when it raises: the transaction is then rolled back anyway). A round
    locks its counter rows once, first; its parts lock them again and move
    their counters several times.

    The row locks are held until the transaction ends, so a kept row is what
    the database would return. Inside the block, read and write the held
    models only through lock_by_pk and update_by_pk."""
    if getattr(_held, "state", None) is not None:
        yield  # an outer block keeps them
        return
    state = _held.state = _Holding(models=held_models, rows={}, changed={})
    try:
        yield
        for (model, pk), names in sorted(state.changed.items(), key=lambda item: (item[0][0].__name__, item[0][1])):
            row = state.rows[(model, pk)]
            _update(model, [pk], {name: getattr(row, name) for name in sorted(names)})
    finally:
        _held.state = None


def _holding(model: type[models.Model]) -> _Holding | None:
    state = getattr(_held, "state", None)
    return state if state is not None and model in state.models else None


def lock_by_pk(model: type[M], pks: Iterable[Pk]) -> dict[Any, M]:
    """SELECT … WHERE pk IN (…) ORDER BY pk FOR UPDATE: the rows that exist, by pk,
    locked in ascending key order (rows already held in `holding` are not
    locked again)."""
    (locked,) = lock_by_pk_together([(model, pks)])
    return locked


_ahead = threading.local()


@contextmanager
def locked_ahead() -> Iterator[None]:
    """Inside one transaction: rows that lock_by_pk_together locked `ahead`
    (in the round trip of its earlier locks) are handed, each once, to the
    first later lock_by_pk_together that asks for them, which sends no
    statement for them. The row locks keep other transactions out; the caller
    makes sure its own code changes none of those rows in between."""
    _ahead.rows = {}
    try:
        yield
    finally:
        _ahead.rows = None


@dataclass(frozen=True)
class LockedBy:
    """A locking read among lock_by_pk_together's `ahead`, for rows not looked
    up by primary key: SELECT … WHERE `where` FOR UPDATE, its rows handed to
    `keep` (which keeps them for the part that asks for them later)."""

    model: type[models.Model]
    where: str
    params: Sequence[Any]
    keep: Callable[[list[Any]], None]


def lock_by_pk_together(
    wanted: Sequence[tuple[type[models.Model], Iterable[Pk]]],
    *,
    ahead: Sequence[tuple[type[models.Model], Iterable[Pk]] | LockedBy] = (),
) -> list[dict[str, Any]]:
    """lock_by_pk for several models in one round trip (select_together), the
    locks taken in the order given: the rows of each that exist, by pk. The
    rows of `ahead` are locked after them, in the same round trip and in the
    order given, and kept for later (locked_ahead, or a LockedBy's `keep`)."""
    db = _db()
    kept: dict[tuple[type[models.Model], Any], Any] | None = getattr(_ahead, "rows", None)
    plans: list[tuple[type[models.Model], list[Pk], _Holding | None, dict[Pk, Any], bool]] = []
    queries: list[tuple[type[models.Model], str, Sequence[Any]]] = []
    for model, pks in wanted:
        asked = sorted(set(pks))
        state = _holding(model)
        given: dict[Pk, Any] = {}
        if state is not None:
            fresh = [pk for pk in asked if (model, pk) not in state.rows]
        else:
            if kept:
                given = {pk: kept.pop((model, pk)) for pk in asked if (model, pk) in kept}
            fresh = [pk for pk in asked if pk not in given]
        if fresh:
            queries.append((model, *_pk_in(_shape(model, db), fresh)))
        plans.append((model, asked, state, given, bool(fresh)))
    later: list[tuple[type[models.Model], list[Pk]] | LockedBy] = []
    for entry in ahead:
        if isinstance(entry, LockedBy):
            queries.append((entry.model, entry.where, entry.params))
            later.append(entry)
            continue
        model, pks = entry
        asked = sorted(set(pks))
        if asked:
            assert kept is not None, "lock ahead only inside locked_ahead()"
            queries.append((model, *_pk_in(_shape(model, db), asked)))
            later.append((model, asked))
    found = iter(select_together(queries, lock=True))
    locked: list[dict[str, Any]] = []
    for model, asked, state, given, sent in plans:
        rows = {row.pk: row for row in next(found)} if sent else {}
        if state is not None:
            for pk, row in rows.items():
                state.rows[(model, pk)] = row
            rows = {pk: state.rows[(model, pk)] for pk in asked if (model, pk) in state.rows}
        rows.update((pk, row) for pk, row in given.items() if row is not None)  # None: asked ahead, not there
        locked.append(rows)
    for entry in later:
        if isinstance(entry, LockedBy):
            entry.keep(next(found))
            continue
        model, asked = entry
        rows = {row.pk: row for row in next(found)}
        for pk in asked:
            kept[(model, pk)] = rows.get(pk)  # type: ignore[index]
    return locked


def lock_fields_by_pk(model: type[M], pks: Iterable[Pk], fields: tuple[str, ...]) -> dict[Any, M]:
    """lock_by_pk reading only `fields` (the primary key among them): the
    others load on first access, as with QuerySet.only(). For a transaction
    that keeps no rows (no holding, no locked_ahead), where a wide lock's
    unread columns would be most of its cost."""
    db = _db()
    shape = _shape_for(model, db.vendor, fields)
    where, wanted = _pk_in(shape, pks)
    if not wanted:
        return {}
    return {row.pk: row for row in _select(db, model, shape, where, wanted, lock=True, skip_locked=False)}


def read_by_pk(model: type[M], pks: Iterable[Pk]) -> dict[Any, M]:
    """The rows that exist, by pk, without a lock (in_bulk)."""
    db = _db()
    shape = _shape(model, db)
    where, wanted = _pk_in(shape, pks)
    if not wanted:
        return {}
    return {row.pk: row for row in _select(db, model, shape, where, wanted, lock=False, skip_locked=False)}


def db_value(model: type[models.Model], field: str, value: Any) -> Any:
    """A value as a query parameter compared with `field` (e.g. an aware datetime
    as the database stores it)."""
    return _concrete_field(model, field).get_db_prep_value(value, _db())


def _concrete_field(model: type[models.Model], name: str) -> models.Field[Any, Any]:
    # Callers name the model's own columns, never a reverse relation.
    return cast("models.Field[Any, Any]", model._meta.get_field(name))


def add_to_row(model: type[models.Model], pk: str, increments: dict[str, int]) -> None:
    """UPDATE … SET column = column + n, … WHERE pk = %s (columns named as fields)."""
    if increments:
        update_by_pk(model, [pk], {name: Add(n) for name, n in increments.items()})


def update_by_pk(model: type[models.Model], pks: Iterable[Pk], values: dict[str, Any]) -> None:
    """One UPDATE giving the rows `pks` the same `values` (field name → value,
    or Add(n)): QuerySet.filter(pk__in=pks).update(**values), sent as is.
    Rows kept by `holding` change in memory instead, written when it ends."""
    pks = list(pks)
    if not pks or not values:
        return
    state = _holding(model)
    if state is not None:
        kept = [pk for pk in pks if (model, pk) in state.rows]
        for pk in kept:
            row = state.rows[(model, pk)]
            for name, value in values.items():
                attname = _concrete_field(model, name).attname
                setattr(row, attname, getattr(row, attname) + value.amount if isinstance(value, Add) else value)
                state.changed.setdefault((model, pk), set()).add(attname)
        pks = [pk for pk in pks if (model, pk) not in state.rows]
    if pks:
        _update(model, pks, values)


def _update(model: type[models.Model], pks: list[Any], values: dict[str, Any]) -> None:
    db = _db()
    quote = db.ops.quote_name
    shape = _shape(model, db)
    sets, params = [], []
    for name, value in values.items():
        field = _concrete_field(model, name)
        column = quote(field.column)
        if isinstance(value, Add):
            sets.append(f"{column} = {column} + %s")
            params.append(value.amount)
        else:
            sets.append(f"{column} = %s")
            params.append(field.get_db_prep_save(value, db))
    where = f"{shape.pk} IN ({', '.join(['%s'] * len(pks))})"
    _write(db, f"UPDATE {shape.table} SET {', '.join(sets)} WHERE {where}", [*params, *pks])


def update_each_by_pk(model: type[models.Model], changes: Mapping[Pk, dict[str, Any]]) -> None:
    """One UPDATE giving each row its own values (pk → field name → value;
    every row names the same fields): SET column = CASE pk WHEN … THEN … END,
    or SET column = value for a column every row gives the same value.
    A lease gives each key row it takes its own token and holder."""
    pks = list(changes)
    if len(pks) <= 1 or _holding(model) is not None:
        for pk in pks:
            update_by_pk(model, [pk], changes[pk])
        return
    db = _db()
    quote = db.ops.quote_name
    shape = _shape(model, db)
    names = list(changes[pks[0]])
    sets, params = [], []
    for name in names:
        field = _concrete_field(model, name)
        values = [changes[pk][name] for pk in pks]
        first = values[0]
        if all(_written_alike(field, db, value, first) for value in values):
            # The same for every row (a lease's time, a holder count): one value, no CASE.
            sets.append(f"{quote(field.column)} = %s")
            params.append(field.get_db_prep_save(first, db))
            continue
        sets.append(f"{quote(field.column)} = CASE {shape.pk}{' WHEN %s THEN %s' * len(pks)} END")
        for pk, value in zip(pks, values, strict=True):
            params += [pk, field.get_db_prep_save(value, db)]
    size = _values_size(params)
    if size > QUERY_VALUES_BUDGET:  # rows as large as results' outputs: half of them at a time
        half = len(pks) // 2
        update_each_by_pk(model, {pk: changes[pk] for pk in pks[:half]})
        update_each_by_pk(model, {pk: changes[pk] for pk in pks[half:]})
        return
    where = f"{shape.pk} IN ({', '.join(['%s'] * len(pks))})"
    _write(db, f"UPDATE {shape.table} SET {', '.join(sets)} WHERE {where}", [*params, *pks], size)


# Types whose equal values (of one type) are written as the same literal.
_EQUAL_WRITTEN_ALIKE = frozenset({str, int, bool, type(None), datetime})


def _written_alike(field: models.Field, db: Any, value: Any, other: Any) -> bool:
    """Whether two values of `field` are written as the same literal. Values
    Python finds equal may not be: JSON {"ok": 1} and {"ok": true}, or keys in
    another order; 0.0 and -0.0. Those are compared as written."""
    if type(value) is not type(other):
        return False
    if type(value) in _EQUAL_WRITTEN_ALIKE:
        return bool(value == other)
    return repr(field.get_db_prep_save(value, db)) == repr(field.get_db_prep_save(other, db))


_MISSING = object()

# Field classes whose save path (pre_save, get_db_prep_save, get_db_prep_value,
# get_prep_value, to_python) returns a value of these exact types unchanged.
_PASSED_AS_IS: tuple[tuple[type[models.Field], tuple[type, ...]], ...] = (
    (models.CharField, (str,)),
    (models.IntegerField, (int,)),
    (models.BooleanField, (bool,)),
    (models.FloatField, (float,)),
)
_SAVE_PATH = ("pre_save", "get_db_prep_save", "get_db_prep_value", "get_prep_value", "to_python")


def _saves_as(field: models.Field, base: type[F]) -> TypeGuard[F]:
    return isinstance(field, base) and all(getattr(type(field), name) is getattr(base, name) for name in _SAVE_PATH)


@dataclass(frozen=True)
class _Column:
    field: models.Field
    attname: str
    as_is: tuple[type, ...]  # values of these types (and None, for a plain field) go as they are
    aware_datetime: bool  # an aware datetime goes through adapt_datetimefield_value only
    stamped: bool  # auto_now or auto_now_add: pre_save sets timezone.now(), which is adapted


@cache
def _insert_columns(model: type[models.Model], vendor: str) -> tuple[_Column, ...]:
    """Each inserted field and the values it would pass through unchanged.
    (Other values, and every field that is not a plain Django one, take the
    field's own pre_save and get_db_prep_save.)"""
    columns = []
    for field in model._meta.concrete_fields:
        if field.generated or (field.primary_key and isinstance(field, models.AutoField)):
            continue
        as_is = next((types for base, types in _PASSED_AS_IS if _saves_as(field, base)), ())
        if isinstance(field, models.IntegerField) and as_is:
            ops = type(_db().ops)
            as_is = as_is if ops.adapt_integerfield_value is BaseDatabaseOperations.adapt_integerfield_value else ()
        stamped = aware_datetime = False
        if _saves_as(field, models.DateTimeField):
            stamped = field.auto_now or field.auto_now_add
            aware_datetime = not stamped
        if as_is or aware_datetime:
            as_is = (*as_is, type(None))
        columns.append(_Column(field, field.attname, as_is, aware_datetime, stamped))
    return tuple(columns)


def insert_rows(objs: Sequence[models.Model], *, sql_values: Mapping[str, Sequence[str]] | None = None) -> None:
    """One INSERT of new rows of one model (bulk_create without returning
    generated keys): each field's pre_save and get_db_prep_save, as the ORM
    does (for plain fields and values they pass unchanged, the value itself).
    `sql_values`: for these fields, each row's value is the given SQL
    expression (trusted text, no parameter), not the object's."""
    if not objs:
        return
    model = type(objs[0])
    db = _db()
    columns = _insert_columns(model, db.vendor)
    adapt_datetime = db.ops.adapt_datetimefield_value
    quote = db.ops.quote_name
    expressions = sql_values or {}
    if expressions:
        rows = [
            "(" + ", ".join(expressions[c.attname][index] if c.attname in expressions else "%s" for c in columns) + ")"
            for index in range(len(objs))
        ]
    else:
        rows = [f"({', '.join(['%s'] * len(columns))})"] * len(objs)
    bound = [column for column in columns if column.attname not in expressions] if expressions else columns
    params: list[Any] = []
    append = params.append
    for obj in objs:
        values = obj.__dict__
        for column in bound:
            if column.stamped:
                value = values[column.attname] = timezone.now()
                append(adapt_datetime(value))
                continue
            value = values.get(column.attname, _MISSING)
            if type(value) in column.as_is:
                append(value)
            elif column.aware_datetime and type(value) is datetime and value.utcoffset() is not None:
                append(adapt_datetime(value))
            else:
                field = column.field
                append(field.get_db_prep_save(field.pre_save(obj, True), db))
        obj._state.adding = False
        obj._state.db = db.alias
    into = f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(column.field.column) for column in columns)})"
    size = _values_size(params)
    if size <= QUERY_VALUES_BUDGET:
        _write(db, f"{into} VALUES {', '.join(rows)}", params, size)
        return
    # Rows as large as payloads and answers: as many INSERTs as the budget needs.
    width, first, size = len(bound), 0, 0
    for index in range(len(objs) + 1):
        row_size = _values_size(params[index * width : (index + 1) * width]) if index < len(objs) else 0
        if index == len(objs) or (size and size + row_size > QUERY_VALUES_BUDGET):
            _write(db, f"{into} VALUES {', '.join(rows[first:index])}", params[first * width : index * width], size)
            first, size = index, 0
        size += row_size


def delete_by_pk(model: type[models.Model], pks: Iterable[Pk]) -> None:
    """delete_by_unique_key on the primary key."""
    delete_by_unique_key(model, (model._meta.pk.attname,), ((pk,) for pk in pks))


def delete_by_unique_key(model: type[models.Model], fields: Sequence[str], keys: Iterable[Sequence[Any]]) -> None:
    """One DELETE … WHERE field = %s AND … per row, `fields` a unique key of
    the model (by attname) and `keys` each row's values of them, sent together
    inside writes_sent_together. Each is a unique lookup that locks its row
    alone, whatever the table's statistics say: an IN list as long as the rows
    MariaDB believes a table holds (a table grown fast since its statistics
    were taken) is planned as a full scan, whose locks wait for every row
    other transactions hold, their uncommitted inserts included."""
    db = _db()
    quote = db.ops.quote_name
    where = " AND ".join(f"{quote(_concrete_field(model, name).column)} = %s" for name in fields)
    sql = f"DELETE FROM {quote(model._meta.db_table)} WHERE {where}"
    for key in keys:
        _write(db, sql, list(key))


def write_statement(sql: str, params: list[Any]) -> None:
    """A write nothing is read back from: inside writes_sent_together, it waits
    and goes with the next statement, as update_by_pk's and insert_rows' do."""
    _write(_db(), sql, params)


_waiting = threading.local()

# The most text of values (str and bytes parameters, before escaping, which at
# most doubles them) one query carries. A query must fit the server's
# max_allowed_packet (MariaDB's default, 16 MiB), and a round joins all its
# writes into one: with payloads and outputs up to a MiB each, a round of many
# goes in several queries, and a statement of many such rows in several.
QUERY_VALUES_BUDGET = 4 * 1024 * 1024


def _values_size(params: Sequence[Any]) -> int:
    return sum([len(param) for param in params if type(param) is str or type(param) is bytes])


class _Waiting(list[tuple[str, list[Any]]]):
    """Writes waiting to go with the next statement, and the size of their values."""

    size = 0

    def clear(self) -> None:
        super().clear()
        self.size = 0


def _write(db: Any, sql: str, params: list[Any], size: int | None = None) -> None:
    waiting: _Waiting | None = getattr(_waiting, "writes", None)
    if waiting is not None:
        size = _values_size(params) if size is None else size
        if waiting and waiting.size + size > QUERY_VALUES_BUDGET:
            _send(db, waiting)
        waiting.append((sql, params))
        waiting.size += size
        return
    with db.cursor() as cursor:
        cursor.execute(sql, params)


def _send(db: Any, statements: _Waiting) -> None:
    """The statements now, in one multi-statement query."""
    sql, params, count = _joined(statements)
    statements.clear()
    with db.cursor() as cursor:
        cursor.execute(sql, params)
        _skip_to_last_result(cursor, count)


@contextmanager
def writes_sent_together(*, commit_with_last_writes: bool = False) -> Iterator[None]:
    """Inside one transaction, on MySQL/MariaDB: the UPDATEs and INSERTs of
    update_by_pk and insert_rows (nothing is read back from them) wait, and go
    in one round trip with the next statement on the connection, the ORM's
    included (a multi-statement query), or when the block ends. The database
    sees every statement in the order it was issued; a write that fails raises
    where it is sent, still inside the transaction (which the caller then
    rolls back). Writes still waiting when the block raises are dropped with
    the transaction. A round issues a dozen writes between its reads; each
    round trip costs the round thread, which every request of the
    application waits for, far more than the statement itself.
    `commit_with_last_writes`: see atomic_sent_together."""
    db = _db()
    if getattr(_waiting, "writes", None) is not None or db.vendor != "mysql":
        yield  # an outer block sends them; elsewhere each write goes at once
        return
    waiting = _Waiting()
    _waiting.writes = waiting
    try:
        with db.execute_wrapper(_sending_waiting_writes):
            yield
            if waiting:
                commits = commit_with_last_writes and _commit_may_ride(db)
                if commits:
                    waiting.append(("COMMIT", []))
                _send(db, waiting)
                if commits:
                    db.commit_sent = True  # the commit Django sends next is done (orbit.db.mysql)
    finally:
        _waiting.writes = None


def _commit_may_ride(db: Any) -> bool:
    """Whether the transaction Django commits next is exactly the one open
    now, with nothing that would make it roll back instead: one atomic block
    (the outermost, no savepoint) and no pending rollback."""
    return (
        hasattr(db, "commit_sent")
        and db.in_atomic_block
        and len(db.atomic_blocks) == 1
        and not db.savepoint_ids
        and not db.needs_rollback
        and not db.closed_in_transaction
    )


@contextmanager
def atomic_sent_together() -> Iterator[None]:
    """transaction.atomic() with writes_sent_together() inside, nothing
    between the two: as the outermost transaction on MySQL/MariaDB, its last
    writes carry its COMMIT, one round trip for both, and the COMMIT Django
    sends on leaving the block is skipped (it is done). A failing write stops
    the query before the COMMIT and raises inside the block, which then rolls
    back as usual."""
    with transaction.atomic(), writes_sent_together(commit_with_last_writes=True):
        yield


def _sending_waiting_writes(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    waiting: _Waiting | None = getattr(_waiting, "writes", None)
    if not waiting:
        return execute(sql, params, many, context)
    alone = many or not isinstance(params, list | tuple)
    if alone:
        # executemany, SQL not to be %-formatted, or named parameters: the writes go first, on their own.
        joined, joined_params, count = _joined(waiting)
    else:
        joined, joined_params, count = _joined([*waiting, (sql, list(params))])
    waiting.clear()
    result = execute(joined, joined_params, False, context)
    _skip_to_last_result(context["cursor"], count)
    return execute(sql, params, many, context) if alone else result


def _joined(statements: list[tuple[str, list[Any]]]) -> tuple[str, list[Any], int]:
    """One multi-statement query of `statements`, its parameters, how many."""
    return "; ".join(sql for sql, _ in statements), [p for _, params in statements for p in params], len(statements)


def _skip_to_last_result(cursor: Any, count: int) -> None:
    """After a multi-statement query: on to the last statement's result, as if
    it had run alone; an error of a later statement raises here, as Django's."""
    with cursor.db.wrap_database_errors:
        for _ in range(count - 1):
            cursor.cursor.nextset()


def keyset_page(rows: models.QuerySet[M], after: Any, limit: int, key: str = "pk") -> tuple[list[M], Any]:
    """One page of `rows` ordered by `key` (unique among them), after the key
    value `after` (None: from the start): the page's rows, and the value to
    continue after, or None when this page is the last one (one row past the
    page is read to know)."""
    if after is not None and after != "":
        rows = rows.filter(**{f"{key}__gt": after})
    taken = list(rows.order_by(key)[: limit + 1])
    page = taken[:limit]
    return page, (getattr(page[-1], key) if len(taken) > limit else None)
