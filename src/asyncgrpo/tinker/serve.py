"""`asyncgrpo tinker-serve`: a local Tinker API server over one base model.

It loads the base model twice, as the other front door (`asyncgrpo train`) does: once in
this process, where the LoRA training models share it, and once in the embedded engine's
own process, which samples. Nothing is downloaded: `--model` is a shipped model's name, a
local Hugging Face directory, or a hub id already in the local cache (`asyncgrpo.base.models`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from asyncgrpo.tinker.sessions import DEFAULT_TTL_S, SDK_HEARTBEAT_S

API_KEY_ENV = "ASYNCGRPO_TINKER_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncgrpo tinker-serve",
        description="Serve the Tinker training API (tinker SDK 0.38) for LoRA models on one "
        "base model: point `tinker.ServiceClient(base_url=...)` at it.",
    )
    parser.add_argument(
        "--model", default="smollm2-135m", help="base model (default: smollm2-135m)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    parser.add_argument(
        "--state-dir",
        default="tinker-state",
        help="where tinker:// checkpoints are written, and the database by default "
        "(default: ./tinker-state)",
    )
    parser.add_argument(
        "--database",
        default=None,
        help="where sessions, models, checkpoints and operations' outcomes are recorded: a "
        "SQLAlchemy URL such as postgresql://USER:PASSWORD@HOST/DB for a team's shared "
        "server (needs `pip install 'asyncgrpo[postgres]'`); the schema is created or "
        "upgraded at start (default: SQLite at STATE_DIR/tinker.sqlite3)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="the engine's weights and the trainer's compute precision (default: auto, "
        "bf16 where the CPU has native bf16 instructions)",
    )
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="the sampling engine's threads (default: 1)"
    )
    parser.add_argument(
        "--trainer-threads", type=int, default=1, help="the trainer's threads (default: 1)"
    )
    parser.add_argument(
        "--session-ttl",
        type=_positive_seconds,
        default=DEFAULT_TTL_S,
        help="seconds a session lives without a heartbeat or request from its client (the "
        f"SDK heartbeats every {SDK_HEARTBEAT_S:g} s); then its pending operations fail and "
        "its models and samplers leave memory, what it saved stays on disk "
        f"(default: {DEFAULT_TTL_S:g})",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="the one line logged per request (method, route, status, latency, session, "
        "model, a refusal's reason) and the service's own records: `key=value` text or one "
        "JSON object per line, on stderr (default: text)",
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def api_key() -> tuple[str, bool]:
    """($ASYNCGRPO_TINKER_API_KEY, False), or a fresh random key and True."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key, False
    return f"tml-local-{secrets.token_urlsafe(24)}", True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.base.models import ModelNotFoundError, resolve_model
    from asyncgrpo.inference.server.connections import run_server
    from asyncgrpo.tinker.app import KEY_PREFIX, create_app

    key, generated = api_key()
    if not key.startswith(KEY_PREFIX):
        print(
            f"error: ${API_KEY_ENV} must start with {KEY_PREFIX!r}: the tinker SDK sends no "
            "other key",
            file=sys.stderr,
        )
        return 2
    try:
        model_dir = resolve_model(args.model)
    except ModelNotFoundError as exc:
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.trainer_threads)
    engine_cfg = EmbeddedEngineConfig(
        model=str(model_dir), dtype=args.dtype, num_threads=args.engine_threads
    )
    service = _build(args, Path(model_dir), engine_cfg)
    if service is None:
        return 2
    if args.session_ttl < 2 * SDK_HEARTBEAT_S:
        print(
            f"warning: --session-ttl {args.session_ttl:g} is under two of the SDK's "
            f"{SDK_HEARTBEAT_S:g} s heartbeat periods: an idle client's session may end "
            "between its heartbeats",
            file=sys.stderr,
        )
    if generated:
        print(f"API key (set {API_KEY_ENV} to choose one): {key}", flush=True)
    print(
        f"asyncgrpo tinker-serve: {args.model} on http://{args.host}:{args.port} "
        f"(tinker.ServiceClient(base_url='http://{args.host}:{args.port}'))",
        flush=True,
    )
    run_server(
        create_app(service, key),
        engine_cfg,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
        request_log_level="info",  # a line per request whatever uvicorn's own level
        log_also=("asyncgrpo.tinker",),
    )
    return 0


def _build(args, model_dir: Path, engine_cfg):
    """The service, or None after saying why its database or state directory is unusable."""
    from asyncgrpo.tinker.build import build_service
    from asyncgrpo.tinker.database import DatabaseError

    try:
        return build_service(
            args.model,
            model_dir,
            engine_cfg,
            Path(args.state_dir),
            session_ttl_s=args.session_ttl,
            database=args.database,
        )
    except DatabaseError as exc:
        print(f"error: --database / --state-dir: {exc}", file=sys.stderr)
        return None
