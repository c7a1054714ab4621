"""`asyncgrpo serve | train`: thin argument parsing over the entry functions.

`serve` runs the embedded engine behind its HTTP server (what `EngineProcess`
launches as a child, and what a user starts by hand to point other tools at).
`train` hands over to `asyncgrpo.run.main`. Errors a user can fix (a wrong
model path, a missing package) print one line and exit non-zero, without a
traceback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

TOKEN_ENV = "ASYNCGRPO_ADMIN_TOKEN"


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def resolve_model_dir(name: str) -> str:
    """A local model directory for `name` (via `asyncgrpo.models` when it is installed)."""
    try:
        from asyncgrpo.models import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        try:
            return str(resolve_model(name))
        except Exception as exc:
            raise CliError(f"cannot resolve model {name!r}: {exc}") from None
    if not os.path.isdir(name):
        looks_like_path = os.sep in name or name.startswith(".")
        raise CliError(
            f"model directory not found: {name}"
            if looks_like_path
            else f"cannot resolve model name {name!r} (asyncgrpo.models is not in this version); "
            "pass a local Hugging Face model directory"
        )
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise CliError(f"{name} is not a Hugging Face model directory (no config.json)")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the embedded engine's HTTP server")
    serve.add_argument("--model", default="smollm2-135m", help="model name or local directory")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    serve.add_argument(
        "--admin-token",
        default=None,
        help=f"bearer token for the control routes (default: ${TOKEN_ENV}; none = refused)",
    )
    serve.add_argument("--served-model-name", default=None, help="name for /v1/models")
    serve.add_argument("--num-threads", type=int, default=None, help="torch threads")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    serve.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=4096,
        help="prompt tokens whose keys/values are kept for prompts sharing a prefix (0: off)",
    )
    serve.add_argument("--max-model-len", type=int, default=None, help="context limit")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--max-body-mb", type=float, default=16, help="request body limit")
    serve.add_argument(
        "--max-weight-body-mb", type=float, default=4096, help="body limit of /update_weights"
    )
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    serve.add_argument(
        "--tool-parser", default="hermes", help="how tool calls are read from generated text"
    )
    serve.add_argument(
        "--max-open-episodes", type=int, default=1024, help="agent episodes open at once"
    )
    serve.add_argument(
        "--episode-idle-timeout",
        type=float,
        default=900.0,
        help="seconds before an idle episode closes",
    )

    commands.add_parser(
        "train", help="train from a recipe (see `asyncgrpo train --help`)", add_help=False
    )
    return parser


def serve(args: argparse.Namespace) -> int:
    from asyncgrpo.engine.process import exit_with_parent

    exit_with_parent()  # a no-op unless started by EngineProcess
    token = args.admin_token or os.environ.get(TOKEN_ENV) or None
    model_dir = resolve_model_dir(args.model)
    from asyncgrpo.agents.toolcalls import get_parser

    try:
        get_parser(args.tool_parser)
    except (KeyError, ValueError) as exc:
        raise CliError(f"--tool-parser: {exc}") from None

    import uvicorn

    from asyncgrpo.engine.engine import Engine, EngineConfig
    from asyncgrpo.server import ServerSettings, create_app

    try:
        engine = Engine(
            EngineConfig(
                model=model_dir,
                dtype=args.dtype,
                max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len,
                prefix_cache_tokens=args.prefix_cache_tokens,
                num_threads=args.num_threads,
                seed=args.seed,
            )
        )
    except Exception as exc:
        raise CliError(f"cannot load model from {model_dir}: {type(exc).__name__}: {exc}") from None
    settings = ServerSettings(
        admin_token=token,
        served_model_name=args.served_model_name or args.model,
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_weight_body_bytes=int(args.max_weight_body_mb * 2**20),
        tool_parser=args.tool_parser,
        max_open_episodes=args.max_open_episodes,
        episode_idle_timeout_s=args.episode_idle_timeout,
    )
    if not _is_loopback(args.host):
        print(f"warning: binding {args.host}: the OpenAI routes are reachable from the network")
    print(
        f"asyncgrpo serve: {settings.served_model_name} ({args.dtype}, max_model_len "
        f"{engine.max_model_len}) on http://{args.host}:{args.port}; control routes "
        + ("enabled" if token else "disabled (no admin token)"),
        flush=True,
    )
    uvicorn.run(
        create_app(engine, settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def train(argv: list[str]) -> int:
    try:
        from asyncgrpo.run import main as train_main
    except ImportError as exc:
        print(f"asyncgrpo train is not available yet in this version ({exc})", file=sys.stderr)
        return 2
    return train_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # `train` owns its arguments (recipe, --set, --resume, ...)
        return train(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
