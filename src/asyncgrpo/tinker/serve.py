"""`asyncgrpo tinker-serve`: a local Tinker API server over one base model.

It loads the base model twice, as the other front door (`asyncgrpo train`) does: once in
this process, where the LoRA training models share it, and once in the embedded engine's
own process, which samples (or, with `--engine vllm`, in a vLLM server's:
`vllm_sampling.py`). Nothing is downloaded: `--model` is a shipped model's name, a
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
    _add_engine_arguments(parser)
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
        "--max-resident-models",
        type=_positive_count,
        default=None,
        metavar="N",
        help="training models kept in memory (adapter, Adam state, pending gradients); "
        "beyond N the least recently used idle one is written to STATE_DIR/offloaded and "
        "comes back, unchanged, on its next request. Samplers' weights are bounded the same "
        "way (default: no bound, everything stays in memory until its session ends)",
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


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """What samples and what trains: the embedded engine (default) or a vLLM server."""
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
        "--engine",
        choices=["embedded", "vllm"],
        default="embedded",
        help="what samples: the embedded engine, which switches between samplers' weights "
        "(default), or a vLLM server, which loads each sampler's weights as a LoRA adapter "
        "of its own and batches them together (for GPUs; needs vLLM: docs/tinker.md)",
    )
    vllm = parser.add_argument_group("--engine vllm")
    vllm.add_argument(
        "--vllm-url",
        default=None,
        help="sample on the vLLM server at this URL instead of launching one; it must run as "
        "tinker-serve launches it (docs/vllm.md) and read STATE_DIR/vllm-adapters",
    )
    vllm.add_argument(
        "--vllm-python",
        default=None,
        help="the Python interpreter whose environment has vLLM (default: this one)",
    )
    vllm.add_argument(
        "--max-lora-rank",
        type=_positive_count,
        default=32,
        help="the largest LoRA rank vLLM serves, rounded up to one it accepts (1, 8, 16, 32, "
        "64, ...); creating a model of a larger rank is refused (default: 32)",
    )
    vllm.add_argument(
        "--max-loras",
        type=_positive_count,
        default=4,
        help="samplers' adapters vLLM holds at once (its --max-loras and CPU LoRA cache); "
        "beyond them the least recently used idle one is unloaded (default: 4)",
    )
    vllm.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the launched vLLM server, repeatable; write options "
        "with '=': --vllm-arg=--gpu-memory-utilization=0.5",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
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
    service = _build(args, Path(model_dir), _sampling_config(args, engine_cfg))
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


def _sampling_config(args, embedded):
    """The configuration of what samples: `embedded` itself, or the vLLM server's."""
    if args.engine != "vllm":
        return embedded
    from asyncgrpo.base.config import VLLMEngineConfig

    return VLLMEngineConfig(
        model=embedded.model,
        dtype=args.dtype,
        base_url=args.vllm_url,
        vllm_python=args.vllm_python,
        max_lora_rank=args.max_lora_rank,
        # the launcher passes `--max-loras 2` (a training run's two adapters) first: vLLM
        # takes the last value given
        vllm_args=["--max-loras", str(args.max_loras), *args.vllm_arg],
    )


def _build(args, model_dir: Path, engine_cfg):
    """The service, or None after saying why its database or state directory is unusable."""
    from asyncgrpo.base.config import ConfigError
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
            max_resident_models=args.max_resident_models,
        )
    except DatabaseError as exc:
        print(f"error: --database / --state-dir: {exc}", file=sys.stderr)
        return None
    except ConfigError as exc:  # vLLM not installed, or not startable
        print(f"error: --engine {args.engine}: {exc}", file=sys.stderr)
        return None
