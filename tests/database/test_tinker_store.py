"""The Tinker service's database: schema, records and what a restarted server reads back.

Each test runs on a fresh SQLite file under a state directory and, marked `postgres`, on a
fresh PostgreSQL database (see conftest.py). The schema comes from the Alembic revisions and
must equal what the code reads and writes (`tables.py`); a database a newer asyncgrpo wrote
is refused before anything is written; a restarted server ends the sessions its process
left live (its own only) and answers polls for that process's operations from their records.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from asyncgrpo.tinker import database, recovery
from asyncgrpo.tinker.database import DatabaseError, create_database_engine
from asyncgrpo.tinker.futures import Outcome
from asyncgrpo.tinker.store import RESTARTED, TinkerStore, now, utc
from asyncgrpo.tinker.tables import futures, metadata

SPEC = {"rank": 4, "seed": 7, "train_mlp": True, "train_attn": False, "train_unembed": True}
MODEL = "session-a:train:0"
STATE = f"tinker://{MODEL}/weights/step-3"


@pytest.fixture
def state_dir(tmp_path):
    return tmp_path / "state"


@pytest.fixture
def store(database_url, state_dir):
    opened = TinkerStore.open(database_url, state_dir)
    yield opened
    opened.close()


def with_a_model(store: TinkerStore) -> None:
    store.session_started("session-a", {"team": "rl"}).result()
    store.model_created(MODEL, "tiny", SPEC, user_metadata={"run": "a"}).result()


def test_the_revisions_build_exactly_the_tables_the_code_uses(store):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection)
        assert compare_metadata(context, metadata) == []
        assert context.get_current_heads() == ("0001",)


def test_reopening_migrates_nothing_and_keeps_the_records(database_url, state_dir):
    first = TinkerStore.open(database_url, state_dir)
    with_a_model(first)
    first.close()
    again = TinkerStore.open(database_url, state_dir)
    try:
        assert again.model(MODEL).lora_rank == 4
    finally:
        again.close()


def test_a_database_of_a_newer_asyncgrpo_is_refused_untouched(database_url, state_dir):
    TinkerStore.open(database_url, state_dir).close()
    engine = create_database_engine(database.database_url(database_url, state_dir))
    with engine.begin() as connection:
        connection.execute(sa.text("UPDATE alembic_version SET version_num = '0999'"))
    with pytest.raises(DatabaseError, match=r"revision '0999'.*newer asyncgrpo wrote it"):
        TinkerStore.open(database_url, state_dir)
    with engine.connect() as connection:  # not "upgraded" over the unknown revision
        assert connection.scalar(sa.text("SELECT version_num FROM alembic_version")) == "0999"
    engine.dispose()


def test_one_server_per_state_dir_and_the_lock_goes_with_the_server(store, state_dir):
    with pytest.raises(DatabaseError, match=r"in use by another tinker-serve \(pid \d+\)"):
        TinkerStore.open(None, state_dir)
    store.close()
    TinkerStore.open(None, state_dir).close()


def test_a_database_that_cannot_be_opened_is_a_clear_error(tmp_path):
    with pytest.raises(DatabaseError, match="not a database URL"):
        TinkerStore.open("nosuchdb://x", tmp_path / "a")
    with pytest.raises(DatabaseError, match="cannot connect"):
        TinkerStore.open("postgresql://nobody:secret@127.0.0.1:1/none", tmp_path / "b")


def test_a_restart_ends_the_sessions_its_process_left_live_and_remembers_why(
    database_url, state_dir, tmp_path
):
    first = TinkerStore.open(database_url, state_dir)
    first.session_started("session-live").result()
    first.session_started("session-closed").result()
    first.session_ended("session-closed", "closed").result()
    first.close()
    # a second server on the same database (a team's PostgreSQL) keeps its live sessions
    other = TinkerStore.open(database_url or database_url_of(state_dir), tmp_path / "other")
    other.session_started("session-of-other").result()
    again = TinkerStore.open(database_url, state_dir)
    try:
        assert again.end_live_sessions() == ["session-live"]
        assert again.end_live_sessions() == []
        ended = dict(again.recently_ended(10))
        assert ended == {"session-live": RESTARTED, "session-closed": "closed"}
    finally:
        again.close()
        other.close()


def database_url_of(state_dir) -> str:
    return database.database_url(None, state_dir)


def test_models_and_checkpoints_are_recorded_and_listed_newest_first(store):
    with_a_model(store)
    store.model_created("session-a:train:1", "tiny", {"rank": 8}).result()
    store.checkpoint_saved(STATE, MODEL, "training", "step-3", 3, 1000).result()
    sampler = f"tinker://{MODEL}/sampler_weights/step-3"
    store.checkpoint_saved(sampler, MODEL, "sampler", "step-3", 3, 400).result()
    store.model_changed(MODEL, step=4).result()
    store.checkpoint_saved(STATE, MODEL, "training", "step-3", 4, 1200).result()  # re-saved

    model = store.model(MODEL)
    assert (model.step, model.state_path, model.train_attn) == (4, STATE, False)
    assert model.user_metadata == {"run": "a"} and model.session_id == "session-a"
    rows, total = store.models_page(limit=1, offset=0)
    assert total == 2 and [r.model_id for r in rows] == ["session-a:train:1"]
    saved = store.checkpoints_of([MODEL])
    assert [(c.tinker_path, c.step, c.size_bytes) for c in saved] == [
        (STATE, 4, 1200),
        (sampler, 3, 400),
    ]
    assert store.checkpoints_page(10, 1)[1] == 2
    assert store.session_model_ids("session-a") == [MODEL, "session-a:train:1"]
    assert store.session_model_ids("session-none") is None
    assert store.checkpoint_deleted(sampler).result() == 1
    assert store.checkpoint(sampler) is None and store.checkpoint(STATE).kind == "training"


def test_outcomes_answer_the_polls_of_a_restarted_server(store):
    with_a_model(store)
    store.checkpoint_saved(STATE, MODEL, "training", "step-3", 3, 1000).result()
    old, new = "0dd0", store.boot
    for n, kind in enumerate(["save_weights", "forward", "optim_step", "forward"], start=1):
        store.submitted(f"req-{old}-{n}", "session-a", MODEL, kind, n)
    store.finished(f"req-{old}-1", Outcome(json={"type": "save_weights", "path": STATE}))
    store.finished(f"req-{old}-2", Outcome(proto=b"log-probs"))
    store.finished(f"req-{old}-3", Outcome(error={"error": "lr: bad", "category": "user"}))
    store.submitted(f"req-{old}-5", "session-a", MODEL, "optim_step", 5)
    store.finished(f"req-{old}-5", Outcome(json={"metrics": {"grad_norm:mean": float("nan")}}))
    store.submitted(f"req-{new}-1", "session-b", None, "sample", None)
    store.writer.flush()

    def answer(request_id):
        row = store.future(request_id)
        return recovery.recorded_outcome(request_id, row, new, store.model(MODEL).state_path)

    assert answer(f"req-{old}-1").json == {"type": "save_weights", "path": STATE}
    lost = answer(f"req-{old}-2").error
    assert lost["category"] == "server" and "kept in memory only" in lost["error"]
    assert answer(f"req-{old}-3").error == {"error": "lr: bad", "category": "user"}
    assert "kept in memory only" in answer(f"req-{old}-5").error["error"]  # NaN: not JSON
    running = answer(f"req-{old}-4").error["error"]
    assert "still running when tinker-serve stopped" in running and STATE in running
    assert "create_training_client_from_state_with_optimizer" in running
    unrecorded = answer(f"req-{old}-99").error["error"]
    assert "lost when tinker-serve stopped" in unrecorded and "whether it ran" in unrecorded
    assert answer(f"req-{new}-1") is None  # this process's, still running: ask again
    for unknown in (f"req-{new}-99", "req-7", "not-a-request"):
        with pytest.raises(KeyError):
            answer(unknown)
    assert store.model(MODEL).last_request_at >= store.model(MODEL).created_at


def test_old_outcomes_are_forgotten_and_recent_ones_kept(store):
    store.submitted("req-0ld0-1", "s", None, "sample", None)
    store.submitted("req-0ld0-2", "s", None, "sample", None)
    store.writer.flush()
    with store.engine.begin() as connection:
        old = futures.update().where(futures.c.request_id == "req-0ld0-1")
        connection.execute(old.values(created_at=now() - timedelta(days=2)))
    assert store.forget_old_outcomes().result() == 1
    assert store.future("req-0ld0-1") is None and store.future("req-0ld0-2") is not None
    assert utc(store.future("req-0ld0-2").created_at).tzinfo is not None


def test_a_burst_of_outcomes_costs_few_commits(store):
    before = store.writer.commits
    for n in range(2000):
        store.submitted(f"req-b-{n}", "s", "s:train:0", "forward", n)
        store.finished(f"req-b-{n}", Outcome(proto=b""))
    store.writer.flush()
    with store.engine.connect() as connection:
        done = sa.select(sa.func.count()).where(futures.c.status == "succeeded")
        assert connection.scalar(done) == 2000
    assert store.writer.commits - before < 400  # batched: not one commit per write
