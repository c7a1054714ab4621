"""`asyncgrpo serve | train | export`: thin argument parsing over the entry functions.

`--help` speaks to a user (what each command does, every flag with its default); this
docstring to a developer.

`serve` runs the embedded engine behind its HTTP server (what `EngineProcess`
launches as a child, and what a user starts by hand to point other tools at);
with `--upstream-url` the same server fronts a vLLM server instead of loading
the weights (`asyncgrpo.inference.vllm.remote_engine`).
Its settings are the fields of `EmbeddedEngineConfig` (a recipe's `engine:` section
of type embedded):
`--config FILE` reads them from a JSON or YAML file, and every field is also a
flag (`--max-model-len 2048`) that overrides the file. The defaults are the
model's own, so a recipe, `asyncgrpo serve` and `Engine` never disagree.
The connection limits and timeouts (`server/connections.py`) are fields too.
`--model` also takes a run's checkpoint (`RUN_DIR/checkpoints/step-N`) or weights
snapshot (`RUN_DIR/weights/step-N.safetensors`): neither is a model directory, so it is
exported (`asyncgrpo.run.export`, LoRA merged) into a temporary directory served from there.
`train` hands over to `asyncgrpo.run.loop.main`. `export` writes a run's trained policy as
a model (or LoRA adapter) directory (`asyncgrpo.run.export`), or a `tinker-serve` saved
state, named by its `tinker://` path and `--state-dir` or by its directory, the same way
(`asyncgrpo.tinker.export`). Errors a user can fix (a wrong
model path, a missing package, a bad value) print one line and exit non-zero,
without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from asyncgrpo.base.config import ConfigError, EmbeddedEngineConfig, ModelConfig, build_config
from asyncgrpo.base.ports import is_loopback

TOKEN_ENV = "ASYNCGRPO_ADMIN_TOKEN"
# EmbeddedEngineConfig fields that describe how a run reaches or launches its engines, not
# the server itself: `serve` offers no flag for them (a --config file may still hold them);
# the other engine types' fields are not `serve`'s at all
CLIENT_SIDE = ("type", "startup_timeout_s", "weight_transport", "replicas")
DESCRIPTION = """\
Train a language model with asynchronous GRPO: an inference engine samples completions
while the trainer learns from the previous ones, then the new weights reach the engine.
`train` runs a recipe, `serve` answers OpenAI-style requests with a model (or a trained
run's checkpoint), `export` turns a run into a model directory that transformers loads."""


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def resolve_model_dir(name: str, scratch: contextlib.ExitStack) -> str:
    """A local model directory for `name`: a shipped model's name, a model directory, or a
    run's checkpoint / weights snapshot (exported to a directory `scratch` removes)."""
    from asyncgrpo.base.models import resolve_model

    found = run_weights(Path(name))
    if found is not None:
        return export_for_serving(*found, scratch)
    try:
        return str(resolve_model(name))
    except Exception as exc:
        raise CliError(f"cannot resolve model {name!r}: {exc}") from None


def run_weights(path: Path) -> tuple[Path, int] | None:
    """(run directory, step) when `path` is `RUN_DIR/checkpoints/step-N` (no config.json
    of its own) or `RUN_DIR/weights/step-N.safetensors`; None for anything else."""
    from asyncgrpo.run.export import STEP_NAME

    match = STEP_NAME.match(path.name)
    if match is None or (path / "config.json").is_file():
        return None
    is_checkpoint = path.parent.name == "checkpoints" and path.is_dir()
    is_snapshot = path.parent.name == "weights" and path.is_file() and bool(match.group(2))
    if not (is_checkpoint or is_snapshot):
        return None
    return path.parent.parent, int(match.group(1))


def export_for_serving(run_dir: Path, step: int, scratch: contextlib.ExitStack) -> str:
    """The run's step as a model directory in a temporary folder (LoRA merged into the base)."""
    from asyncgrpo.run.export import ExportError, export_run

    out_dir = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="asyncgrpo-serve-")))
    try:
        print(export_run(run_dir, out_dir / "model", step=step, merged=True), flush=True)
    except ExportError as exc:
        raise CliError(f"cannot serve step {step} of {run_dir}: {exc}") from None
    return str(out_dir / "model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncgrpo",
        description=DESCRIPTION,
        epilog="`asyncgrpo COMMAND --help` describes each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "train",
        help="train a model from a recipe (see `asyncgrpo train --help`)",
        add_help=False,
    )
    commands.add_parser(
        "plot",
        help="redraw a run's PNG plots, or compare runs (see `asyncgrpo plot --help`)",
        add_help=False,
    )
    commands.add_parser(
        "tinker-serve",
        help="serve the Tinker training API for LoRA models (see `asyncgrpo tinker-serve --help`)",
        add_help=False,
    )
    commands.add_parser(
        "plan",
        help="predict throughput, idle time and staleness of layouts (see `asyncgrpo plan --help`)",
        add_help=False,
    )
    add_serve_parser(commands)
    add_export_parser(commands)
    return parser


def add_serve_parser(commands) -> None:
    """`serve`'s own flags, then one flag per server-side `EmbeddedEngineConfig` field."""
    serve = commands.add_parser(
        "serve",
        help="serve a model (or a run's checkpoint) over an OpenAI-compatible HTTP API",
        description="Serve a model with the embedded engine behind OpenAI-compatible routes "
        "(/v1/completions, /v1/chat/completions). Every engine setting below is also a field "
        "of a recipe's `engine:` section; flags override --config.",
    )
    serve.add_argument(
        "--config",
        help="a JSON/YAML file of engine settings (a recipe's `engine:` section) "
        "(default: none, every setting at its default)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    serve.add_argument(
        "--admin-token",
        default=None,
        help=f"bearer token for the control routes (default: ${TOKEN_ENV}; unset: those "
        "routes are refused)",
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        help="uvicorn's log level; at info, one line per request (default: warning)",
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="the request lines: `key=value` text or one JSON object per line (default: text)",
    )
    for name, field in EmbeddedEngineConfig.model_fields.items():
        if name not in CLIENT_SIDE:
            serve.add_argument(
                f"--{name.replace('_', '-')}",
                dest=f"engine.{name}",
                default=argparse.SUPPRESS,
                metavar=name.upper(),
                help=field_help(name, field),
            )


def field_help(name: str, field) -> str:
    """A field's docstring and default as help text (`%` escaped for argparse)."""
    if name == "model":  # serve's own meaning of an unset model
        from asyncgrpo.base.models import DEFAULT_MODEL

        doc = (
            "a model directory, a shipped model's name, a hub id in the local Hugging Face "
            "cache, or a run's RUN_DIR/checkpoints/step-N or RUN_DIR/weights/step-N.safetensors"
        )
        default = DEFAULT_MODEL
    else:
        doc = " ".join((field.description or "").split())
        default = field.get_default(call_default_factory=True)
    return f"{doc} (default: {default})".replace("%", "%%")


def add_export_parser(commands) -> None:

    export = commands.add_parser(
        "export", help="write a run's trained model (or LoRA adapter) as a loadable directory"
    )
    export.add_argument(
        "run_dir",
        metavar="SOURCE",
        help="the run directory (holds config.yaml, checkpoints/), or a Tinker saved state: "
        "its directory, or the tinker://MODEL_ID/weights/NAME path with --state-dir",
    )
    export.add_argument("out_dir", help="where to write it (must not exist, or be empty)")
    which = export.add_mutually_exclusive_group()
    which.add_argument(
        "--step",
        type=int,
        help="the checkpoint or weights snapshot of this step (default: the best held-out "
        "evaluation's weights where the run kept them, else the newest)",
    )
    which.add_argument(
        "--last", action="store_true", help="the newest step, even where a best one was kept"
    )
    export.add_argument(
        "--merged",
        action="store_true",
        help="LoRA runs: merge the adapter into the base model (default: the adapter alone)",
    )
    export.add_argument(
        "--state-dir",
        help="where `asyncgrpo tinker-serve --state-dir` saved a tinker:// SOURCE",
    )


def engine_config(args: argparse.Namespace) -> EmbeddedEngineConfig:
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
        return build_config(data, overrides, model=EmbeddedEngineConfig)
    except ConfigError as exc:
        raise CliError(str(exc).replace("\n", " ")) from None


def serve(args: argparse.Namespace) -> int:
    from asyncgrpo.inference.engine.process import exit_with_parent

    exit_with_parent()  # a no-op unless started by EngineProcess
    cfg = engine_config(args)
    name = cfg.model or ModelConfig().name_or_path
    with contextlib.ExitStack() as scratch:  # a checkpoint's exported copy, removed on exit
        cfg = cfg.model_copy(update={"model": resolve_model_dir(name, scratch)})
        serve_model(args, cfg, name)
    return 0


def serve_model(args: argparse.Namespace, cfg: EmbeddedEngineConfig, name: str) -> None:
    """Load `cfg.model` and answer requests until interrupted."""
    token = args.admin_token or os.environ.get(TOKEN_ENV) or None
    from asyncgrpo.inference.server.toolcalls import get_parser

    try:
        get_parser(cfg.tool_parser)
    except (KeyError, ValueError) as exc:
        raise CliError(f"--tool-parser: {exc}") from None

    from asyncgrpo.inference.server import ServerSettings, create_app
    from asyncgrpo.inference.server.connections import run_server

    engine, generating_with = build_engine(cfg)
    settings = ServerSettings.from_config(cfg, admin_token=token, default_name=name)
    if not is_loopback(args.host):
        print(f"warning: binding {args.host}: the OpenAI routes are reachable from the network")
    print(
        f"asyncgrpo serve: {settings.served_model_name} ({generating_with}, max_model_len "
        f"{engine.max_model_len}) on http://{args.host}:{args.port}; control routes "
        + ("enabled" if token else "disabled (no admin token)"),
        flush=True,
    )
    app = create_app(engine, settings)
    run_server(
        app,
        cfg,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def export(args: argparse.Namespace) -> int:
    from asyncgrpo.run.export import ExportError, export_run

    try:
        tinker_state = find_tinker_state(args.run_dir, args.state_dir)
        if tinker_state is not None:
            if args.step is not None or args.last:
                raise ExportError("--step/--last pick a run's step; a Tinker state has one")
            from asyncgrpo.tinker.export import export_tinker_state

            print(export_tinker_state(tinker_state, args.out_dir, merged=args.merged))
        else:
            print(
                export_run(
                    args.run_dir, args.out_dir, step=args.step, merged=args.merged, last=args.last
                )
            )
    except ExportError as exc:
        raise CliError(str(exc)) from None
    return 0


def find_tinker_state(source: str, state_dir: str | None) -> Path | None:
    """The Tinker saved state `source` names (`asyncgrpo.tinker.export`), else None."""
    if not source.startswith("tinker://") and not Path(source, "state.json").is_file():
        if state_dir is not None:
            raise CliError("--state-dir goes with a tinker:// SOURCE")
        return None  # a run directory: no need to import the Tinker package
    from asyncgrpo.tinker.export import tinker_checkpoint

    return tinker_checkpoint(source, state_dir)


def build_engine(cfg: EmbeddedEngineConfig):
    """(engine, what generates): the embedded engine, or a vLLM server's with `upstream_url`."""
    from asyncgrpo.inference.engine.types import RequestError

    if cfg.upstream_url:
        from asyncgrpo.inference.vllm.remote_engine import RemoteEngine

        try:
            engine = RemoteEngine(cfg)
        except RequestError as exc:
            raise CliError(f"--upstream-url: {exc.message}") from None
        except OSError as exc:  # no tokenizer or config in the model directory
            raise CliError(f"cannot load the tokenizer from {cfg.model}: {exc}") from None
        return engine, f"vLLM at {engine.upstream_url}, {engine.dtype.removeprefix('torch.')}"
    from asyncgrpo.inference.engine.engine import Engine

    try:
        return Engine(cfg), cfg.resolved_dtype()
    except Exception as exc:
        raise CliError(f"cannot load model from {cfg.model}: {type(exc).__name__}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # `train` owns its arguments (recipe, --set, --resume, ...)
        from asyncgrpo.run.loop import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["plot"]:  # so does `plot` (run directories, --compare)
        from asyncgrpo.learning.metrics import plot_main

        return plot_main(argv[1:])
    if argv[:1] == ["plan"]:  # and `plan` (a grid of layouts; imports no torch)
        from asyncgrpo.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["tinker-serve"]:  # and `tinker-serve` (its own server)
        from asyncgrpo.tinker.serve import main as tinker_main

        return tinker_main(argv[1:])
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
