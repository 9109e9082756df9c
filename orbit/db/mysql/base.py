"""MySQL backend: no foreign-key constraints, multi-statement queries, and
autocommit changes that ride on the next statement.

Orbit's schema rule is zero foreign keys in the whole database, Django's own
contrib apps included. Reporting no foreign-key support makes the schema editor
skip every constraint while still indexing the relation columns.

A round sends the writes it reads nothing back from together with its next
statement, in one round trip (orbit.db.rows.writes_sent_together); that takes
CLIENT.MULTI_STATEMENTS. Every statement Orbit sends is built with bound
parameters, escaped by the driver, so a value can never end one statement
and start another.

Django turns autocommit off to begin each transaction and on again after its
COMMIT, and the driver sends each change as a statement of its own: two round
trips per transaction that carry nothing. Here the change is sent as the first
statement of the next query instead, and not at all when the server already
has it (a transaction that ran no statement). The server then sees the same
statements in the same order: a transaction's first statement still runs
with autocommit off, and the first one after COMMIT with it on.

DATETIME values are parsed by `datetime.fromisoformat` (C) instead of the
driver's DateTime_or_None (Python, slicing and int() per part), which took
~4% of the server's CPU under load, reading task and attempt rows; anything
fromisoformat does not take (a zero date, say) still goes to the driver's.
The other way, an aware datetime already in the connection's time zone (every
timezone.now(), every value read back) is written as Django writes it without
Django's checks, which cost a round more than the text itself. And the
driver escapes each bound value through `Connection.literal`, a chain of type
tests: a round binds thousands, nearly all of them strings, integers and
NULLs, which take the driver's own conversion for their type at once.
"""

from collections.abc import Iterator
from datetime import datetime
from typing import Any, cast

from django.db import IntegrityError
from django.db.backends.mysql import base, features, operations, schema
from MySQLdb import OperationalError, connections
from MySQLdb.constants import CLIENT, FIELD_TYPE
from MySQLdb.converters import None2NULL, Thing2Str
from MySQLdb.times import DateTime_or_None


def datetime_or_none(value: str) -> datetime | None:
    """DateTime_or_None's result for every DATETIME text the server sends."""
    if len(value) in (19, 26):  # YYYY-MM-DD HH:MM:SS[.ffffff]
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    return DateTime_or_None(value)


conversions = {**base.django_conversions, FIELD_TYPE.DATETIME: datetime_or_none}


class Connection(connections.Connection):
    """The driver's connection; `literal` gives the driver's own text for every
    value, a str, an int or None without its chain of type tests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The quick path holds while the conversions are the driver's own.
        self.quick_literals = self.encoders.get(int) is Thing2Str and self.encoders.get(type(None)) is None2NULL

    def literal(self, o: Any) -> bytes:
        kind = type(o)
        if kind is str:
            # The stubs give string_literal str; the driver returns the quoted bytes.
            return cast(bytes, self.string_literal(o.encode(self.encoding)))
        if self.quick_literals:
            if kind is int:
                return str(o).encode(self.encoding)
            if o is None:
                return b"NULL"
        return super().literal(o)


class DatabaseFeatures(features.DatabaseFeatures):
    supports_foreign_keys = False


class DatabaseOperations(operations.DatabaseOperations):
    def adapt_datetimefield_value(self, value: Any) -> Any:
        """Django's text for every value: for one in the connection's own zone
        (the same tzinfo object), its make_naive is the value without its zone."""
        if type(value) is datetime and value.tzinfo is not None and value.tzinfo is self.connection.timezone:
            return str(value.replace(tzinfo=None))
        return super().adapt_datetimefield_value(value)


class DatabaseSchemaEditor(schema.DatabaseSchemaEditor):
    def _iter_column_sql(
        self, column_db_type: Any, params: Any, model: Any, field: Any, field_db_params: Any, include_default: Any
    ) -> Iterator[str]:
        """A generated column's COMMENT after its GENERATED clause, where MySQL
        and MariaDB take it; Django 5.2 puts it before (its ticket #35839)."""
        # Private to Django's schema editors, so not in its stubs.
        parts = super()._iter_column_sql(  # type: ignore[misc]
            column_db_type, params, model, field, field_db_params, include_default
        )
        if not (field.generated and field.db_comment):
            yield from parts
            return
        comment = self._comment_sql(field.db_comment)  # type: ignore[attr-defined]
        yield from (part for part in list(parts) if part != comment)
        yield comment


class CursorWrapper(base.CursorWrapper):
    def __init__(self, cursor: Any, wrapper: "DatabaseWrapper") -> None:
        super().__init__(cursor)
        self.wrapper = wrapper

    def _autocommit_change(self) -> str | None:
        """The SET the server needs to have Django's autocommit, if any."""
        wanted = self.wrapper.autocommit
        return None if self.cursor.connection.get_autocommit() == wanted else f"SET autocommit={int(wanted)}"

    def execute(self, query: str, args: Any = None) -> Any:
        change = self._autocommit_change()
        if change is None:
            return super().execute(query, args)
        super().execute(f"{change}; {query}", args)
        try:
            self.cursor.nextset()  # on to the query's own result, as if it had run alone
        except OperationalError as error:
            if error.args[0] in self.codes_for_integrityerror:
                raise IntegrityError(*tuple(error.args)) from error
            raise
        return self.cursor.rowcount

    def executemany(self, query: str, args: Any) -> Any:
        change = self._autocommit_change()
        if change is not None:
            super().execute(change)
        return super().executemany(query, args)


# A server process answers every request within orbit.db.pool's deadline
# (4.5 s), so its connections give up on a server that stopped answering
# sooner than the settings' (which suit commands: a migration may take long):
# a statement's lock wait ends first (a retryable error), then the statement,
# and the server rolls back the transaction of a connection that went away.
SERVING_TIMEOUTS = {"connect_timeout": 2, "read_timeout": 3, "write_timeout": 3}
SERVING_LOCK_WAIT_SECONDS = 2
# A transaction left idle this long is rolled back and its connection closed
# by MariaDB itself: a server process frozen or hung inside a round (SIGSTOP,
# a VM pause) holds the application's and queue's counter rows at most this
# long, so every other node's rounds go on after a few seconds, not hours
# (wait_timeout is 8 h). The process that wakes finds its connection gone: its
# request answers 503 and commits nothing. A round's statements follow each
# other within milliseconds, so only a stopped process ever reaches it.
# MariaDB 10.3+ only (a versioned comment: MySQL reads it as a comment).
SERVING_IDLE_TRANSACTION_SECONDS = 3
# Set by orbit.asgi: this process serves requests.
serving = False


class DatabaseWrapper(base.DatabaseWrapper):
    features_class = DatabaseFeatures
    ops_class = DatabaseOperations
    SchemaEditorClass = DatabaseSchemaEditor
    # Set by orbit.db.rows.atomic_sent_together when a transaction's last writes
    # carried its COMMIT: the commit Django asks for next is already done.
    commit_sent = False

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        params["client_flag"] = params.get("client_flag", 0) | CLIENT.MULTI_STATEMENTS
        if params.get("conv") is base.django_conversions:  # not one of the settings' OPTIONS
            params["conv"] = conversions
        if serving:
            params.update(SERVING_TIMEOUTS)
            params["init_command"] = (
                f"SET SESSION innodb_lock_wait_timeout = {SERVING_LOCK_WAIT_SECONDS}"
                f" /*M!100300 , idle_transaction_timeout = {SERVING_IDLE_TRANSACTION_SECONDS} */"
            )
        return params

    def get_new_connection(self, conn_params: dict[str, Any]) -> Connection:
        connection = Connection(**conn_params)
        # As Django's own: the driver's bytes "encoder" is not one (mysqlclient #489).
        if connection.encoders.get(bytes) is bytes:
            connection.encoders.pop(bytes)
        return connection

    def create_cursor(self, name: str | None = None) -> CursorWrapper:
        return CursorWrapper(self.connection.cursor(), self)

    def _commit(self) -> None:
        if self.commit_sent:
            self.commit_sent = False
            return
        # django-stubs leave out BaseDatabaseWrapper's private _commit and _rollback.
        super()._commit()  # type: ignore[misc]

    def _rollback(self) -> None:
        self.commit_sent = False
        super()._rollback()  # type: ignore[misc]

    def _set_autocommit(self, autocommit: bool) -> None:
        """Nothing is sent now: see CursorWrapper (Django records `autocommit` itself)."""
