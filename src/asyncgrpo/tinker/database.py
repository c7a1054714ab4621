"""The database behind `asyncgrpo tinker-serve`: opened, migrated and locked at start.

By default a SQLite file under `--state-dir`, beside the checkpoints it lists; `--database`
takes a PostgreSQL URL instead, for a team's shared server. SQLAlchemy (Core) runs the same
statements on both, and Alembic keeps the schema: a new database gets every table, an older
one the revisions it lacks (`migrations/`), and one written by a newer asyncgrpo is refused
before anything is written, rather than read wrongly. Both are the standard Python tools for
this; a hand-written dialect layer and version table would redo them less well.

SQLite runs in WAL mode with `synchronous=NORMAL`: a commit survives the server's kill -9
(it is in the log before the commit returns; only a crash of the machine itself may lose
the last ones), readers do not block the writer, and a commit costs no fsync. One server
uses one state directory at a time (a lock file there): two would end each other's sessions
at their starts.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

SQLITE_FILE = "tinker.sqlite3"
LOCK_FILE = "tinker-serve.lock"
_MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_MIGRATION_LOCK = 61_000_417  # a PostgreSQL advisory lock: one server migrates at a time


class DatabaseError(RuntimeError):
    """The database cannot be used; the message says why and what to do."""


def database_url(given: str | None, state_dir: Path) -> str:
    """The SQLAlchemy URL: `given`, a `postgresql://` one run on psycopg 3; by default the
    SQLite file under `state_dir`."""
    if not given:
        return f"sqlite:///{(Path(state_dir) / SQLITE_FILE).resolve()}"
    scheme, colon, rest = given.partition(":")
    if colon and scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg:{rest}"
    return given


def shown(url: str) -> str:
    """`url` without its password, for messages and logs."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<not a database URL>"


def server_identity(state_dir: Path) -> str:
    """What names this server among those sharing a database: its host and state dir."""
    return f"{socket.gethostname()}:{Path(state_dir).resolve()}"


def create_database_engine(url: str) -> Engine:
    """An engine on `url`, connected once to prove it answers."""
    try:
        engine = sa.create_engine(url, pool_pre_ping=True)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
        raise DatabaseError(
            f"{shown(url)}: not a database URL this server can open ({exc}). Give "
            "sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DATABASE (PostgreSQL needs "
            "the psycopg package: pip install 'asyncgrpo[postgres]')"
        ) from None
    if engine.dialect.name == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_settings)
    try:
        with engine.connect():
            pass
    except sa.exc.DBAPIError as exc:
        engine.dispose()
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise DatabaseError(f"{shown(url)}: cannot connect: {reason}") from None
    return engine


def _sqlite_settings(connection, _record) -> None:
    cursor = connection.cursor()
    for pragma in (
        "journal_mode=WAL",
        "synchronous=NORMAL",
        "foreign_keys=ON",
        "busy_timeout=30000",
    ):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def migrate(engine: Engine) -> str:
    """Bring the schema to this code's newest revision (which it returns); a database at a
    revision this code does not know (written by a newer asyncgrpo) is refused."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    script = ScriptDirectory.from_config(config)
    head = script.get_current_head()
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})"))
        for revision in MigrationContext.configure(connection).get_current_heads():
            try:
                script.get_revision(revision)
            except CommandError:
                raise DatabaseError(
                    f"{shown(str(engine.url))} holds schema revision {revision!r}, which this "
                    f"asyncgrpo does not know (it knows up to {head!r}): a newer asyncgrpo "
                    "wrote it. Run that version, or give --database another database"
                ) from None
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
    return head


def lock_state_dir(state_dir: Path):
    """Hold the state directory for this process (released when it exits, kill -9
    included): the open lock file, or `DatabaseError` naming the process that holds it."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    handle = (state_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise DatabaseError(
            f"--state-dir {state_dir} is in use by another tinker-serve (pid {holder}): "
            "give each server a state directory of its own"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
