"""The operator console (Django's admin, read only): its dashboard and the
figures its pages show, read from counters, the per-minute rollup and
index-ordered LIMIT queries, never from a scan of the task table."""
