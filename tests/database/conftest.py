"""The Tinker service's database under test: SQLite always, PostgreSQL where one is given.

Tests that take `database_url` run on a fresh SQLite file and, marked `postgres`, on a fresh
database of the server `ASYNCGRPO_TEST_POSTGRES_URL` names (`make test-postgres` installs
PostgreSQL, starts one on loopback and sets it: `tests/postgres_server.py`). Without that
variable the PostgreSQL cases skip, saying so; with it, a server that does not answer fails
them: a PostgreSQL run that skipped silently would prove nothing.
"""

from __future__ import annotations

import os
import secrets

import pytest

URL_ENV = "ASYNCGRPO_TEST_POSTGRES_URL"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"postgres: needs a PostgreSQL server (${URL_ENV}; `make test-postgres`)"
    )


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        pytest.skip(
            f"no PostgreSQL server: set {URL_ENV}=postgresql://USER@HOST:PORT/DB, or run "
            "`make test-postgres`, which installs PostgreSQL and starts one on loopback"
        )
    return url


@pytest.fixture
def postgres_database(postgres_server_url):
    """A new, empty database on the server, dropped afterwards; its URL."""
    import sqlalchemy as sa

    from asyncgrpo.tinker.database import create_database_engine, database_url

    name = f"asyncgrpo_test_{secrets.token_hex(4)}"
    admin = create_database_engine(database_url(postgres_server_url, None))
    admin = admin.execution_options(isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(postgres_server_url).set(database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    """None (the default: SQLite under the state dir) or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres_database")
