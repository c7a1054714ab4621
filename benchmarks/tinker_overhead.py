"""What the Tinker API costs per GRPO step, against the same work done in process.

A GRPO step as a Tinker client runs it (tinker-cookbook's `rl_loop.py`): sample a group
of G completions for each of P prompts, then `forward_backward` (importance_sampling)
over the P*G datums, then `optim_step`. This runs that step two ways on one server, one
model and the same data, alternating step by step:

- `api`: the unmodified `tinker` SDK against `asyncgrpo tinker-serve` (its app under
  uvicorn on a thread, the engine its own process);
- `direct`: the same calls without the API: the engine's `/v1/completions` through
  `EngineClient`, and `LoraModels.forward_backward` / `optim_step` in process — the
  trainer primitives `asyncgrpo train`'s step is composed of.

Both ways send the new adapter to the engine once per step (the API when the inflight
sampler next samples, `direct` right after its optimizer step; counted there). Overhead =
api / direct - 1, per phase and per step (medians over the steps).

    .venv/bin/python benchmarks/tinker_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import uvicorn

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.models import resolve_model
from asyncgrpo.base.ports import free_port
from asyncgrpo.inference.backend.embedded import EmbeddedBackend
from asyncgrpo.learning.trainer.datums import AdamParams
from asyncgrpo.tinker.app import create_app
from asyncgrpo.tinker.build import build_service
from asyncgrpo.tinker.wire import TinkerDatum

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path, not run
    sys.path.append(str(Path(__file__).resolve().parent))
from result_files import SCRATCH, write_result  # noqa: E402

KEY = "tml-benchmark"
PHASES = ("sample_s", "forward_backward_s", "optim_step_s", "step_s")


def start_server(args, state_dir: Path, max_resident_models: int | None = None):
    """tinker-serve's app over `args.model` under uvicorn on a thread, once it answers:
    the service, the uvicorn server and its URL."""
    model_dir = resolve_model(args.model)
    engine = EmbeddedEngineConfig(model=str(model_dir), num_threads=args.engine_threads)
    service = build_service(
        args.model, model_dir, engine, state_dir, max_resident_models=max_resident_models
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, KEY), port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    return service, server, f"http://127.0.0.1:{port}"


def grpo_datums(prompts, groups) -> list[TinkerDatum]:
    """One datum per sample: the sampler's log-probs and a centred reward per token."""
    datums = []
    for prompt, group in zip(prompts, groups, strict=True):
        rewards = np.array([len(set(tokens)) for tokens, _ in group], dtype=np.float32)
        for (tokens, logprobs), advantage in zip(group, rewards - rewards.mean(), strict=True):
            full = list(prompt) + list(tokens)
            p = len(prompt) - 1  # target positions before the first sampled token
            inputs = {
                "target_tokens": np.array(full[1:], dtype=np.int64),
                "logprobs": np.array([0.0] * p + list(logprobs), dtype=np.float32),
                "advantages": np.array([0.0] * p + [advantage] * len(tokens), dtype=np.float32),
            }
            datums.append(TinkerDatum(np.array(full[:-1], dtype=np.int64), inputs))
    return datums


def api_step(tinker, trainer, sampler, prompts, args) -> dict:
    types = tinker.types
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    times, start = {}, time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
    groups = [[(s.tokens, s.logprobs) for s in f.result().sequences] for f in futures]
    times["sample_s"] = time.perf_counter() - start
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(d.tokens.tolist()),
            loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in d.inputs.items()},
        )
        for d in grpo_datums(prompts, groups)
    ]
    mark = time.perf_counter()
    trainer.forward_backward(data, "importance_sampling").result()
    times["forward_backward_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    trainer.optim_step(types.AdamParams(learning_rate=args.lr)).result()
    times["optim_step_s"] = time.perf_counter() - mark
    times["step_s"] = time.perf_counter() - start
    return times


def direct_step(service, backend, loop, model_id, prompts, args, version: int) -> dict:
    times, start, client = {}, time.perf_counter(), backend.client

    async def sample_all():
        return await asyncio.gather(
            *(client.complete(p, n=args.group, max_tokens=args.max_tokens) for p in prompts)
        )

    completions = loop.run_until_complete(sample_all())
    groups = [[(s.token_ids, s.logprobs) for s in c.samples] for c in completions]
    times["sample_s"] = time.perf_counter() - start
    datums = grpo_datums(prompts, groups)
    mark = time.perf_counter()
    service.models.forward_backward(model_id, datums, "importance_sampling")
    times["forward_backward_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    service.models.optim_step(model_id, AdamParams(learning_rate=args.lr))
    # the new weights reach the engine, as the API's next sample of an inflight sampler does
    weights = service.models.sampler_weights(model_id)
    loop.run_until_complete(backend.sync_weights(weights, version, "keep"))
    times["optim_step_s"] = time.perf_counter() - mark
    times["step_s"] = time.perf_counter() - start
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per way")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=SCRATCH / "tinker_overhead.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tempfile

    import tinker

    torch.set_num_threads(args.trainer_threads)
    with tempfile.TemporaryDirectory() as state:
        service, server, url = start_server(args, Path(state))
        try:
            result = measure(tinker, service, url, args)
        finally:
            server.should_exit = True
    report(result, args, argv)


def measure(tinker, service, url, args) -> dict:
    with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
        return measure_with(client, service, tinker, args)


def measure_with(client, service, tinker, args) -> dict:
    """Per way ("api": through the SDK, "direct": the engine's client), each step's times."""
    trainer = client.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0)
    trainer = trainer.result()
    model_id = trainer.get_info().model_id
    sampler = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    tokenizer = trainer.get_tokenizer()
    prompts = [
        tokenizer.encode(f"Write {n} words about the sea.") for n in range(3, 3 + args.prompts)
    ]
    # a second handle on the server's engine process, with its own client and transport
    engine = EmbeddedBackend(service.backend.cfg, process=service.backend.process)
    engine.launch()
    loop = asyncio.new_event_loop()
    ways = {"api": [], "direct": []}
    for step in range(args.steps + 1):  # the first of each is a warm-up
        for way in ("api", "direct") if step % 2 == 0 else ("direct", "api"):
            if way == "api":
                times = api_step(tinker, trainer, sampler, prompts, args)
            else:
                times = direct_step(service, engine, loop, model_id, prompts, args, 10**6 + step)
            if step:
                ways[way].append(times)
    loop.run_until_complete(engine.transport.close())
    loop.run_until_complete(engine.client.aclose())
    return ways


def report(ways: dict, args, argv: list[str] | None = None) -> None:
    medians = {
        way: {phase: statistics.median(t[phase] for t in runs) for phase in PHASES}
        for way, runs in ways.items()
    }
    overhead = {p: medians["api"][p] / medians["direct"][p] - 1 for p in PHASES}
    print(f"{'phase':<20}{'direct s':>10}{'api s':>10}{'overhead':>10}")
    for phase in PHASES:
        print(
            f"{phase:<20}{medians['direct'][phase]:>10.3f}{medians['api'][phase]:>10.3f}"
            f"{overhead[phase]:>+10.1%}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = dict(settings=vars(args) | {"out": str(args.out)}, runs=ways, medians=medians)
    args.out.write_text(json.dumps(result | {"overhead": overhead}, indent=1) + "\n")
    print(f"wrote {args.out}")
    write_result("tinker_overhead", result | {"overhead": overhead}, argv)


if __name__ == "__main__":
    main()
