"""The schema of the Tinker service's database, as Alembic revisions.

`database.migrate` runs them at every start: a new database gets every table, an older one
the revisions it lacks, and one written by a newer asyncgrpo (a revision this code does not
have) is refused. There is no `alembic.ini`: `env.py` runs on the connection it is handed.

A schema change is a new file in `versions/` whose `down_revision` is the newest one's
`revision`, with `upgrade()` written with `alembic.op` (and `tables.py` changed to match);
`tests/unit/test_tinker_store.py` checks that the revisions build exactly the tables
`tables.py` describes.
"""
