"""Alembic's entry point for the Tinker service's schema: it runs the revisions on the
connection that `database.migrate` puts in `config.attributes["connection"]`."""

from alembic import context

context.configure(connection=context.config.attributes["connection"])
with context.begin_transaction():
    context.run_migrations()
