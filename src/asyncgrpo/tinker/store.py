"""What the Tinker service records in its database, and the reads its listings make.

Written through one `BatchWriter`, in order: a session when it starts and ends, a model
when it is created (with its session, base model and LoRA spec), its step count as it
trains and the path it last saved to or loaded from, every checkpoint written (path, model,
kind, step, size, time), and each operation's outcome (submitted, then succeeded with its
JSON answer or failed with its error). The writes a client must be able to rely on once
answered (a session, a model, a checkpoint) return a future the caller waits on; outcomes
are not waited on: they cost the request path a queue put.

At open, the sessions this server left live (it was killed, or stopped) are ended as
`restarted`: their models' state since their last save, their samplers and their pending
operations died with the process. Reads are blocking calls: run them off the event loop.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from asyncgrpo.tinker import database
from asyncgrpo.tinker.db_writer import BatchWriter
from asyncgrpo.tinker.tables import checkpoints, futures, models, sessions

RESTARTED = "restarted"
KEEP_OUTCOMES_S = 24 * 3600.0  # operations' outcomes kept this long for late polls

# the writes of every operation, prepared once and run over a batch's rows together
SUBMITTED = futures.insert()
FINISHED = (
    futures.update()
    .where(futures.c.request_id == sa.bindparam("finished_id"))
    .values(
        status=sa.bindparam("status"),
        error=sa.bindparam("error"),
        error_category=sa.bindparam("error_category"),
        result=sa.bindparam("result"),
        finished_at=sa.bindparam("finished_at"),
    )
)
MODEL_HEARD = (
    models.update()
    .where(models.c.model_id == sa.bindparam("heard_id"))
    .values(last_request_at=sa.bindparam("heard_at"))
)


def now() -> datetime:
    return datetime.now(UTC)


def _storable(answer: dict | None) -> bool:
    """Whether a JSON answer can be kept: PostgreSQL's JSON refuses NaN and infinities
    (a diverged step's gradient norm); such an answer is kept in memory only."""
    try:
        json.dumps(answer, allow_nan=False)
    except ValueError:
        return False
    return True


def utc(when: datetime | None) -> datetime | None:
    """A time read back (SQLite returns it without its zone, which is UTC)."""
    if when is None or when.tzinfo is not None:
        return when
    return when.replace(tzinfo=UTC)


class TinkerStore:
    """The service's records in one database (SQLite or PostgreSQL)."""

    def __init__(self, engine: Engine, server: str, lock=None):
        self.engine = engine
        self.server = server
        self.boot = secrets.token_hex(4)  # in every request id of this process
        self.writer = BatchWriter(engine, (SUBMITTED, FINISHED, MODEL_HEARD))
        self._lock = lock

    @classmethod
    def open(cls, url: str | None, state_dir: Path) -> TinkerStore:
        """Lock `state_dir`, connect to `url` (default: SQLite under `state_dir`), bring its
        schema up to date; `database.DatabaseError` when any of it cannot be done."""
        lock = database.lock_state_dir(state_dir)
        try:
            engine = database.create_database_engine(database.database_url(url, state_dir))
            try:
                database.migrate(engine)
            except BaseException:
                engine.dispose()
                raise
        except BaseException:
            lock.close()
            raise
        return cls(engine, database.server_identity(state_dir), lock)

    def close(self) -> None:
        self.writer.close()
        self.engine.dispose()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ---- sessions --------------------------------------------------------------------

    def session_started(self, session_id: str, user_metadata: dict | None = None):
        row = dict(session_id=session_id, server=self.server, started_at=now())
        row["user_metadata"] = user_metadata
        return self.writer.write(lambda c: c.execute(sessions.insert().values(**row)))

    def session_ended(self, session_id: str, how: str):
        update = (
            sessions.update()
            .where(sessions.c.session_id == session_id, sessions.c.ended_at.is_(None))
            .values(ended_at=now(), end_reason=how)
        )
        return self.writer.write(lambda c: c.execute(update))

    def end_live_sessions(self) -> list[str]:
        """End, as `restarted`, the sessions this server left live; their ids."""
        live = sa.and_(sessions.c.server == self.server, sessions.c.ended_at.is_(None))
        with self.engine.begin() as c:
            ids = list(c.scalars(sa.select(sessions.c.session_id).where(live)))
            c.execute(sessions.update().where(live).values(ended_at=now(), end_reason=RESTARTED))
        return ids

    def recently_ended(self, limit: int) -> list[tuple[str, str]]:
        """(session id, how it ended) of the `limit` sessions that ended last, oldest first."""
        query = (
            sa.select(sessions.c.session_id, sessions.c.end_reason)
            .where(sessions.c.ended_at.is_not(None))
            .order_by(sessions.c.ended_at.desc())
            .limit(limit)
        )
        with self.engine.connect() as c:
            return [(row.session_id, row.end_reason) for row in c.execute(query)][::-1]

    # ---- models and checkpoints --------------------------------------------------------

    def model_created(
        self,
        model_id: str,
        base_model: str,
        spec: dict,
        step: int = 0,
        state_path: str | None = None,
        user_metadata: dict | None = None,
    ) -> concurrent.futures.Future:
        """A new model of the session its id names (`s:train:k`)."""
        when = now()
        row = dict(
            model_id=model_id,
            session_id=model_id.split(":", 1)[0],
            base_model=base_model,
            lora_rank=spec["rank"],
            seed=spec.get("seed"),
            train_mlp=spec.get("train_mlp", True),
            train_attn=spec.get("train_attn", True),
            train_unembed=spec.get("train_unembed", True),
            step=step,
            state_path=state_path,
            created_at=when,
            last_request_at=when,
            user_metadata=user_metadata,
        )
        return self.writer.write(lambda c: c.execute(models.insert().values(**row)))

    def model_changed(self, model_id: str, step: int | None = None, state_path: str | None = None):
        """The model took a request: its step count and state path when they changed."""
        values: dict[str, Any] = {"last_request_at": now()}
        if step is not None:
            values["step"] = step
        if state_path is not None:
            values["state_path"] = state_path
        update = models.update().where(models.c.model_id == model_id).values(**values)
        return self.writer.write(lambda c: c.execute(update))

    def checkpoint_saved(
        self, path: str, model_id: str, kind: str, name: str, step: int, size_bytes: int
    ) -> concurrent.futures.Future:
        """`path` was written (again, when the name was used before): its row replaces any
        earlier one; a training state also becomes its model's state path."""
        row = dict(tinker_path=path, model_id=model_id, kind=kind, name=name, step=step)
        row.update(size_bytes=size_bytes, created_at=now())

        def record(c) -> None:
            c.execute(checkpoints.delete().where(checkpoints.c.tinker_path == path))
            c.execute(checkpoints.insert().values(**row))
            values: dict[str, Any] = {"last_request_at": row["created_at"]}
            if kind == "training":
                values["state_path"] = path
            c.execute(models.update().where(models.c.model_id == model_id).values(**values))

        return self.writer.write(record)

    def checkpoint_deleted(self, path: str) -> concurrent.futures.Future:
        delete = checkpoints.delete().where(checkpoints.c.tinker_path == path)
        return self.writer.write(lambda c: c.execute(delete).rowcount)

    # ---- operations' outcomes (the `FutureTable`'s journal) ------------------------------

    def submitted(self, request_id: str, session_id, model_id, kind: str, seq_id) -> None:
        when = now()
        row = dict(request_id=request_id, session_id=session_id, model_id=model_id, kind=kind)
        row.update(seq_id=seq_id, status="pending", created_at=when)
        row.update(error=None, error_category=None, result=None, finished_at=None)
        self.writer.add(SUBMITTED, row)
        if model_id is not None and ":train:" in model_id:  # a request to a model
            self.writer.add(MODEL_HEARD, {"heard_id": model_id, "heard_at": when}, model_id)

    def finished(self, request_id: str, outcome) -> None:
        """`outcome`: a `futures.Outcome`; its JSON answer is kept, protobuf bytes are not."""
        row: dict[str, Any] = {"finished_id": request_id, "finished_at": now()}
        if outcome.error is not None:
            row.update(
                status="failed",
                error=str(outcome.error.get("error")),
                error_category=outcome.error.get("category"),
                result=None,
            )
        else:
            result = outcome.json if _storable(outcome.json) else None
            row.update(status="succeeded", error=None, error_category=None, result=result)
        self.writer.add(FINISHED, row)

    def forget_old_outcomes(self, older_than_s: float = KEEP_OUTCOMES_S):
        cutoff = now() - timedelta(seconds=older_than_s)
        delete = futures.delete().where(futures.c.created_at < cutoff)
        return self.writer.write(lambda c: c.execute(delete).rowcount)

    # ---- reads -----------------------------------------------------------------------

    def _one(self, query):
        with self.engine.connect() as c:
            return c.execute(query).first()

    def _page(self, query, order, limit: int, offset: int) -> tuple[list, int]:
        total = sa.select(sa.func.count()).select_from(query.subquery())
        with self.engine.connect() as c:
            rows = list(c.execute(query.order_by(*order).limit(limit).offset(offset)))
            return rows, int(c.scalar(total))

    def future(self, request_id: str):
        return self._one(sa.select(futures).where(futures.c.request_id == request_id))

    def model(self, model_id: str):
        return self._one(sa.select(models).where(models.c.model_id == model_id))

    def models_page(self, limit: int, offset: int) -> tuple[list, int]:
        order = (models.c.created_at.desc(), models.c.model_id)
        return self._page(sa.select(models), order, limit, offset)

    def checkpoint(self, path: str):
        return self._one(sa.select(checkpoints).where(checkpoints.c.tinker_path == path))

    def checkpoints_of(self, model_ids: list[str]) -> list:
        """The checkpoints of these models, newest first."""
        query = (
            sa.select(checkpoints)
            .where(checkpoints.c.model_id.in_(model_ids))
            .order_by(checkpoints.c.created_at.desc(), checkpoints.c.tinker_path)
        )
        with self.engine.connect() as c:
            return list(c.execute(query))

    def checkpoints_page(self, limit: int, offset: int) -> tuple[list, int]:
        order = (checkpoints.c.created_at.desc(), checkpoints.c.tinker_path)
        return self._page(sa.select(checkpoints), order, limit, offset)

    def sessions_page(self, limit: int, offset: int) -> tuple[list, int]:
        order = (sessions.c.started_at.desc(), sessions.c.session_id)
        return self._page(sa.select(sessions), order, limit, offset)

    def session_model_ids(self, session_id: str) -> list[str] | None:
        """The models of a session, None for a session the database does not know."""
        with self.engine.connect() as c:
            known = c.execute(
                sa.select(sessions.c.session_id).where(sessions.c.session_id == session_id)
            ).first()
            if known is None:
                return None
            query = sa.select(models.c.model_id).where(models.c.session_id == session_id)
            return list(c.scalars(query.order_by(models.c.created_at)))
