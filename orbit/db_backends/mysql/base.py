"""MySQL backend that never creates foreign-key constraints, and whose
connections accept multi-statement queries.

Orbit's schema rule is zero foreign keys in the whole database, Django's own
contrib apps included. Reporting no foreign-key support makes the schema editor
skip every constraint while still indexing the relation columns.

A round sends the writes it reads nothing back from together with its next
statement, in one round trip (orbit.rows.writes_sent_together); that takes
CLIENT.MULTI_STATEMENTS. Every statement Orbit sends is built with bound
parameters, escaped by the driver, so a value can never end one statement
and start another.
"""

from typing import Any

from django.db.backends.mysql import base, features
from MySQLdb.constants import CLIENT


class DatabaseFeatures(features.DatabaseFeatures):
    supports_foreign_keys = False


class DatabaseWrapper(base.DatabaseWrapper):
    features_class = DatabaseFeatures

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        params["client_flag"] = params.get("client_flag", 0) | CLIENT.MULTI_STATEMENTS
        return params
