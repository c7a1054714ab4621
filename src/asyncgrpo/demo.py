"""`make demo` until the training pipeline lands: the engine server and one scripted client.

Starts `asyncgrpo serve` on the default model (SmolLM2-135M-Instruct) as a
child process, asks one chat question through the async client, and prints the
answer with what RL needs from every token: its id, its log-probability under
the distribution it was sampled from, and the weight version that sampled it.
Then it stops the server and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from asyncgrpo.cli import CliError, resolve_model_dir
from asyncgrpo.client import EngineClient
from asyncgrpo.engine.process import EngineProcess, EngineProcessError

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or local directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        model_dir = resolve_model_dir(args.model)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = Path(tempfile.gettempdir()) / "asyncgrpo-demo-engine.log"
    log.unlink(missing_ok=True)
    print(f"starting the engine on {model_dir} (log: {log}) ...", flush=True)
    proc = EngineProcess(
        model_dir,
        dtype=args.dtype,
        num_threads=args.num_threads,
        max_num_seqs=8,
        log_path=log,
    )
    try:
        proc.start()
        proc.wait_ready(300)
        asyncio.run(ask(proc, args.max_tokens))
    except EngineProcessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
