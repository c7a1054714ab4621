"""`asyncgrpo serve | train | export`: thin argument parsing over the entry functions.

`serve` runs the embedded engine behind its HTTP server (what `EngineProcess`
launches as a child, and what a user starts by hand to point other tools at);
with `--upstream-url` the same server fronts a vLLM server instead of loading
the weights (`asyncgrpo.vllm.remote_engine`).
Its settings are the fields of `EngineConfig` (a recipe's `engine:` section):
`--config FILE` reads them from a JSON or YAML file, and every field is also a
flag (`--max-model-len 2048`) that overrides the file. The defaults are the
model's own, so a recipe, `asyncgrpo serve` and `Engine` never disagree.
The connection limits and timeouts (`server/connections.py`) are fields too.
`train` hands over to `asyncgrpo.run.main`. `export` writes a run's trained policy as
a model (or LoRA adapter) directory (`asyncgrpo.export`). Errors a user can fix (a wrong
model path, a missing package, a bad value) print one line and exit non-zero,
without a traceback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from asyncgrpo.config import ConfigError, EngineConfig, ModelConfig, build_config

TOKEN_ENV = "ASYNCGRPO_ADMIN_TOKEN"
# EngineConfig fields that describe how a trainer reaches an engine, not the server itself
CLIENT_SIDE = ("type", "base_url", "admin_token_env", "startup_timeout_s", "weight_transport")


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def resolve_model_dir(name: str) -> str:
    """A local model directory for `name` (a shipped model's name or a directory)."""
    from asyncgrpo.models import resolve_model

    try:
        return str(resolve_model(name))
    except Exception as exc:
        raise CliError(f"cannot resolve model {name!r}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the embedded engine's HTTP server")
    serve.add_argument("--config", help="engine settings (a recipe's `engine:` section), JSON/YAML")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--admin-token",
        default=None,
        help=f"bearer token for the control routes (default: ${TOKEN_ENV}; none = refused)",
    )
    serve.add_argument("--log-level", default="warning", help="uvicorn log level")
    for name, field in EngineConfig.model_fields.items():
        if name in CLIENT_SIDE:
            continue
        doc = " ".join((field.description or "").split())
        serve.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"engine.{name}",
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{doc} (default: {field.default})",
        )

    commands.add_parser(
        "train", help="train from a recipe (see `asyncgrpo train --help`)", add_help=False
    )

    export = commands.add_parser(
        "export", help="write a run's trained model (or LoRA adapter) as a loadable directory"
    )
    export.add_argument("run_dir", help="the run directory (holds config.yaml, checkpoints/)")
    export.add_argument("out_dir", help="where to write it (must not exist, or be empty)")
    export.add_argument(
        "--step", type=int, help="the checkpoint or weights snapshot of this step (default: newest)"
    )
    export.add_argument(
        "--merged", action="store_true", help="LoRA runs: merge the adapter into the base model"
    )
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The file's settings, overridden by the flags given, validated once."""
    import yaml

    data: dict = {}
    if args.config:
        try:
            with open(args.config) as f:
                data = yaml.safe_load(f) or {}  # JSON is YAML
        except (OSError, yaml.YAMLError) as exc:
            raise CliError(f"--config {args.config}: {exc}") from None
    flags = {k.split(".", 1)[1]: v for k, v in vars(args).items() if k.startswith("engine.")}
    overrides = [f"{key}={value}" for key, value in flags.items()]
    try:
        return build_config(data, overrides, model=EngineConfig)
    except ConfigError as exc:
        raise CliError(str(exc).replace("\n", " ")) from None


def serve(args: argparse.Namespace) -> int:
    from asyncgrpo.engine.process import exit_with_parent

    exit_with_parent()  # a no-op unless started by EngineProcess
    cfg = engine_config(args)
    token = args.admin_token or os.environ.get(TOKEN_ENV) or None
    name = cfg.model or ModelConfig().name_or_path
    cfg = cfg.model_copy(update={"model": resolve_model_dir(name)})
    from asyncgrpo.agents.toolcalls import get_parser

    try:
        get_parser(cfg.tool_parser)
    except (KeyError, ValueError) as exc:
        raise CliError(f"--tool-parser: {exc}") from None

    from asyncgrpo.server import ServerSettings, create_app
    from asyncgrpo.server.connections import run_server

    engine, generating_with = build_engine(cfg)
    settings = ServerSettings.from_config(cfg, admin_token=token, default_name=name)
    if not _is_loopback(args.host):
        print(f"warning: binding {args.host}: the OpenAI routes are reachable from the network")
    print(
        f"asyncgrpo serve: {settings.served_model_name} ({generating_with}, max_model_len "
        f"{engine.max_model_len}) on http://{args.host}:{args.port}; control routes "
        + ("enabled" if token else "disabled (no admin token)"),
        flush=True,
    )
    run_server(
        create_app(engine, settings), cfg, host=args.host, port=args.port, log_level=args.log_level
    )
    return 0


def export(args: argparse.Namespace) -> int:
    from asyncgrpo.export import ExportError, export_run

    try:
        print(export_run(args.run_dir, args.out_dir, step=args.step, merged=args.merged))
    except ExportError as exc:
        raise CliError(str(exc)) from None
    return 0


def build_engine(cfg: EngineConfig):
    """(engine, what generates): the embedded engine, or a vLLM server's with `upstream_url`."""
    from asyncgrpo.engine.types import EngineError

    if cfg.upstream_url:
        from asyncgrpo.vllm.remote_engine import RemoteEngine

        try:
            engine = RemoteEngine(cfg)
        except EngineError as exc:
            raise CliError(f"--upstream-url: {exc.message}") from None
        except OSError as exc:  # no tokenizer or config in the model directory
            raise CliError(f"cannot load the tokenizer from {cfg.model}: {exc}") from None
        return engine, f"vLLM at {engine.upstream_url}, {engine.dtype.removeprefix('torch.')}"
    from asyncgrpo.engine.engine import Engine

    try:
        return Engine(cfg), cfg.resolved_dtype()
    except Exception as exc:
        raise CliError(f"cannot load model from {cfg.model}: {type(exc).__name__}: {exc}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # `train` owns its arguments (recipe, --set, --resume, ...)
        from asyncgrpo.run import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return export(args) if args.command == "export" else serve(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
