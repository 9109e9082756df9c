"""MySQL backend that never creates foreign-key constraints.

Orbit's schema rule is zero foreign keys in the whole database, Django's own
contrib apps included. Reporting no foreign-key support makes the schema editor
skip every constraint while still indexing the relation columns.
"""

from django.db.backends.mysql import base, features


class DatabaseFeatures(features.DatabaseFeatures):
    supports_foreign_keys = False


class DatabaseWrapper(base.DatabaseWrapper):
    features_class = DatabaseFeatures
