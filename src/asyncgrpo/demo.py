"""`make demo`: a short asynchronous GRPO run on the shipped model, then what it learned.

Trains SmolLM2-135M-Instruct with `recipes/demo.yaml` on the CPU (engine and
trainer overlap, one core each), then prints held-out reward before and after
and where the plots are. `--serve` instead starts `asyncgrpo serve` on the
model and prints one chat answer with what RL needs from every token: its id,
its log-probability under the distribution it was sampled from, and the weight
version that sampled it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.engine_errors import EngineStartError
from asyncgrpo.cli import CliError, resolve_model_dir
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.learning.trainer.best import best_summary

QUESTION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
]


async def ask(proc: EngineProcess, max_tokens: int) -> None:
    async with EngineClient(proc.base_url, admin_token=proc.admin_token) as client:
        info = await client.server_info()
        print(
            f"engine: {info['model']} ({info['dtype']}, max_model_len {info['max_model_len']}, "
            f"weight version {info['weight_version']}) at {proc.base_url}\n"
        )
        body = {
            "messages": QUESTION,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        response = (await client.request("POST", "/v1/chat/completions", json=body)).json()
    choice = response["choices"][0]
    print(f"user:      {QUESTION[-1]['content']}")
    print(f"assistant: {choice['message']['content']}\n")
    print(f"prompt: {len(response['prompt_token_ids'])} tokens; completion (greedy):")
    print(f"  {'token id':>8}  {'log-prob':>9}  {'version':>7}  text")
    for token_id, entry, version in zip(
        choice["token_ids"], choice["logprobs"]["content"], choice["weight_versions"]
    ):
        print(f"  {token_id:>8}  {entry['logprob']:>9.4f}  {version:>7}  {entry['token']!r}")
    print(f"finish_reason: {choice['finish_reason']}")


def train_demo(recipe: str, overrides: list[str]) -> int:
    import json

    from asyncgrpo.base.config import ConfigError, load_config
    from asyncgrpo.run.loop import train
    from asyncgrpo.run.session import RunAborted

    if not Path(recipe).exists():
        print(f"error: recipe {recipe} not found (run `make demo` from the repository root)")
        return 2
    try:
        cfg = load_config(recipe, overrides)
        print(
            f"training {cfg.model.name_or_path} with {recipe}: {cfg.max_steps} steps, "
            f"at most {cfg.max_time_s or 0:.0f}s; progress below, details in runs/{cfg.name}/\n"
        )
        run_dir = train(cfg)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    except RunAborted as exc:
        print(f"run aborted: {exc}")
        return 1
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    evals = [x for x in lines if x.get("kind") == "eval"]
    steps = [x for x in lines if x.get("kind") == "train"]
    print()
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        print(
            f"held-out reward (greedy, {first.get('eval_count', '?')} prompts): "
            f"{first['eval_reward_mean']:.3f} before -> {last['eval_reward_mean']:.3f} "
            f"after {last['step']} steps"
        )
        if (best := best_summary(run_dir, last)) is not None:
            print(f"{best} (kept in best/)")
    if steps:
        print(
            f"trained {steps[-1]['step']} steps in {steps[-1]['time_s'] / 60:.1f} min; "
            f"staleness max {max(x.get('staleness_max', 0) for x in steps)}"
        )
    plots = sorted((run_dir / "plots").glob("*.png"))
    print(f"plots: {', '.join(str(p) for p in plots) or 'none'}")
    print(f"run directory: {run_dir} (metrics.jsonl, samples.jsonl, checkpoints/)")
    return 0


def serve_demo(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as scratch:  # a run checkpoint is exported for the demo
        try:
            model_dir = resolve_model_dir(args.model, scratch)
        except CliError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _serve_demo(args, model_dir)


def _serve_demo(args: argparse.Namespace, model_dir: str) -> int:
    log = Path(tempfile.gettempdir()) / "asyncgrpo-demo-engine.log"
    log.unlink(missing_ok=True)
    print(f"starting the engine on {model_dir} (log: {log}) ...", flush=True)
    config = EmbeddedEngineConfig(
        model=model_dir, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=8
    )
    proc = EngineProcess(config, log_path=log)
    try:
        proc.start()
        proc.wait_ready(300)
        asyncio.run(ask(proc, args.max_tokens))
    except EngineStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        proc.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--recipe", default="recipes/demo.yaml", help="recipe to train")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override",
    )
    parser.add_argument("--serve", action="store_true", help="serve demo instead of training")
    parser.add_argument("--model", default="smollm2-135m", help="(--serve) model or directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.serve:
        return serve_demo(args)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return train_demo(args.recipe, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
