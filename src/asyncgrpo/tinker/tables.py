"""The Tinker service's tables, as SQLAlchemy Core reads and writes them.

What must outlive the server process is kept here: the sessions (and how each ended), the
training models (their session, base model, LoRA spec, steps taken, and where their state
was last saved or loaded from), every checkpoint written under `--state-dir`, and the
outcome of every operation a client was given a request id for. The schema these tables
describe is created and upgraded by the revisions in `migrations/versions/` (a revision is
a frozen copy of the schema at its time; these definitions are what the code reads and
writes now, and must equal the newest revision's result).

Times are UTC. A future's `model_id` is the model or the sampler it ran on; its `result`
is the JSON answer of an operation that answers JSON (a saved path, a new model's id),
`None` for one whose answer is protobuf (log-probs, samples), which only memory keeps.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("session_id", sa.String(), primary_key=True),
    sa.Column("server", sa.String(), nullable=False),  # host and --state-dir of its server
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("end_reason", sa.String(), nullable=True),  # expired, closed, restarted
    sa.Column("user_metadata", sa.JSON(), nullable=True),
    sa.Index("ix_sessions_ended_at", "ended_at"),
    sa.Index("ix_sessions_server_live", "server", "ended_at"),
)

models = sa.Table(
    "models",
    metadata,
    sa.Column("model_id", sa.String(), primary_key=True),
    sa.Column("session_id", sa.String(), sa.ForeignKey("sessions.session_id"), nullable=False),
    sa.Column("base_model", sa.String(), nullable=False),
    sa.Column("lora_rank", sa.Integer(), nullable=False),
    sa.Column("seed", sa.BigInteger(), nullable=True),
    sa.Column("train_mlp", sa.Boolean(), nullable=False),
    sa.Column("train_attn", sa.Boolean(), nullable=False),
    sa.Column("train_unembed", sa.Boolean(), nullable=False),
    sa.Column("step", sa.Integer(), nullable=False),  # optimizer steps taken
    sa.Column("state_path", sa.String(), nullable=True),  # last saved to or loaded from
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("user_metadata", sa.JSON(), nullable=True),
    sa.Index("ix_models_session_id", "session_id"),
    sa.Index("ix_models_created_at", "created_at"),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("tinker_path", sa.String(), primary_key=True),
    sa.Column("model_id", sa.String(), sa.ForeignKey("models.model_id"), nullable=False),
    sa.Column("kind", sa.String(), nullable=False),  # training or sampler (the SDK's names)
    sa.Column("name", sa.String(), nullable=False),
    sa.Column("step", sa.Integer(), nullable=False),
    sa.Column("size_bytes", sa.BigInteger(), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_checkpoints_model_id", "model_id"),
    sa.Index("ix_checkpoints_created_at", "created_at"),
)

futures = sa.Table(
    "futures",
    metadata,
    sa.Column("request_id", sa.String(), primary_key=True),
    sa.Column("session_id", sa.String(), nullable=True),
    sa.Column("model_id", sa.String(), nullable=True),
    sa.Column("kind", sa.String(), nullable=False),
    sa.Column("seq_id", sa.Integer(), nullable=True),
    sa.Column("status", sa.String(), nullable=False),  # pending, succeeded, failed
    sa.Column("error", sa.Text(), nullable=True),
    sa.Column("error_category", sa.String(), nullable=True),
    sa.Column("result", sa.JSON(), nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("ix_futures_created_at", "created_at"),
)
