"""The revisions, oldest first by `down_revision` (Alembic reads every file here but this one)."""
