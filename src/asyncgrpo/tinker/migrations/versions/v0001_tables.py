"""Sessions, models, checkpoints and futures' outcomes.

Revision ID: 0001
Revises: (none)
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    when = sa.DateTime(timezone=True)
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(), primary_key=True),
        sa.Column("server", sa.String(), nullable=False),
        sa.Column("started_at", when, nullable=False),
        sa.Column("ended_at", when, nullable=True),
        sa.Column("end_reason", sa.String(), nullable=True),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
    )
    op.create_index("ix_sessions_ended_at", "sessions", ["ended_at"])
    op.create_index("ix_sessions_server_live", "sessions", ["server", "ended_at"])
    op.create_table(
        "models",
        sa.Column("model_id", sa.String(), primary_key=True),
        sa.Column("session_id", sa.String(), sa.ForeignKey("sessions.session_id"), nullable=False),
        sa.Column("base_model", sa.String(), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("train_mlp", sa.Boolean(), nullable=False),
        sa.Column("train_attn", sa.Boolean(), nullable=False),
        sa.Column("train_unembed", sa.Boolean(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("state_path", sa.String(), nullable=True),
        sa.Column("created_at", when, nullable=False),
        sa.Column("last_request_at", when, nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=True),
    )
    op.create_index("ix_models_session_id", "models", ["session_id"])
    op.create_index("ix_models_created_at", "models", ["created_at"])
    op.create_table(
        "checkpoints",
        sa.Column("tinker_path", sa.String(), primary_key=True),
        sa.Column("model_id", sa.String(), sa.ForeignKey("models.model_id"), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", when, nullable=False),
    )
    op.create_index("ix_checkpoints_model_id", "checkpoints", ["model_id"])
    op.create_index("ix_checkpoints_created_at", "checkpoints", ["created_at"])
    op.create_table(
        "futures",
        sa.Column("request_id", sa.String(), primary_key=True),
        sa.Column("session_id", sa.String(), nullable=True),
        sa.Column("model_id", sa.String(), nullable=True),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_category", sa.String(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("created_at", when, nullable=False),
        sa.Column("finished_at", when, nullable=True),
    )
    op.create_index("ix_futures_created_at", "futures", ["created_at"])


def downgrade() -> None:
    for table in ("futures", "checkpoints", "models", "sessions"):
        op.drop_table(table)
