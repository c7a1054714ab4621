"""The embedded engine on one GPU against transformers' two ways of generating, and a
decode step against the device's physical limit.

Why: the engine's CUDA path (`engine.device: cuda`, experimental) is the same paged-KV,
FlexAttention code the CPU tests check; whether it is worth running needs its speed
beside what a GRPO user has without vLLM, on the same GPU, weights and prompts, and how
far a decode step is from what the memory and the matmul units allow.

Systems, one after another in this process on one random-weight model (saved once, each
system loads it, the previous one freed first):

  embedded    asyncgrpo's `Engine` in process (`Engine.generate`), every request at once
  generate    transformers `model.generate`: left-padded batches (`--generate-batch-size`,
              0: one), each as long as its longest request
  continuous  transformers continuous batching (what TRL's `use_transformers_paged` runs):
              a manager started untimed, then every request with its own length
              (gpu_engine_peers.py: older releases, and none at all)

Workloads (random prompt ids, EOS ignored, sampling at temperature 1, no top-k/top-p):

  nano     nano-vllm's benchmark: `--nano-sequences` sequences, prompt and output lengths
           uniform in [`--nano-min`, `--nano-max`], seeded
  grpo256  engine_throughput.py's: 32 prompts x 4 samples, 256 tokens each, here with
           fixed prompt and output lengths (random weights never stop by themselves)

Tokens/s counts the tokens each request asked for, so a padded batch pays for its padding.
The limit of a decode step at batch B (`--limit-batches`) with `--limit-context` keys per
sequence: max((weight bytes + the batch's KV bytes) / copy bandwidth, FLOPs / bf16
matmul rate), both measured here; the engine's step is timed on its own runner (prefilled,
then decode steps with the sampler, synchronised).

Every system, workload and the limit is guarded: one failing records its error and the
rest still run; the JSON (`--out`) is rewritten after each, the result file
(`result_files.py`) at the end.

    ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE=1 python benchmarks/gpu_engine.py --out gpu_engine.json
    .venv/bin/python benchmarks/gpu_engine.py --shape tiny --device cpu --nano-sequences 8 \\
        --nano-min 8 --nano-max 32   # the CPU smoke shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from decode_limit import measure_limit  # benchmarks/ is on sys.path
from gpu_engine_peers import ContinuousSystem, GenerateSystem, Unavailable, free_memory
from result_files import SCRATCH, write_result
from trainer_speed import model_config

SYSTEMS = ("embedded", "generate", "continuous")
PHASES = ("embedded", "limit", "generate", "continuous")  # `--systems`: these, in this order
WORKLOADS = ("grpo256", "nano")
CUDA_GATE = "ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE"


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt
    samples: int

    def rows(self) -> list[tuple[list[int], int]]:
        """(prompt, max tokens) of every sequence, each prompt `samples` times."""
        return [(p, m) for p, m in zip(self.prompts, self.max_tokens) for _ in range(self.samples)]

    def summary(self) -> dict:
        rows = self.rows()
        return {
            "sequences": len(rows),
            "prompt_tokens": sum(len(p) for p, _ in rows),
            "output_tokens": sum(m for _, m in rows),
            "longest": max(len(p) + m for p, m in rows),
        }


def make_workloads(args, vocab: int) -> list[Workload]:
    rng = random.Random(args.seed)
    out = []
    for name in args.workloads.split(","):
        if name == "nano":
            count, spread = args.nano_sequences, (args.nano_min, args.nano_max)
            inputs = [rng.randint(*spread) for _ in range(count)]
            outputs = [rng.randint(*spread) for _ in range(count)]
            prompts = [[rng.randrange(vocab) for _ in range(n)] for n in inputs]
            out.append(Workload(name, prompts, outputs, 1))
        elif name == "grpo256":
            prompts = [
                [rng.randrange(vocab) for _ in range(args.grpo_prompt_len)]
                for _ in range(args.grpo_prompts)
            ]
            out.append(
                Workload(name, prompts, [args.grpo_tokens] * len(prompts), args.grpo_samples)
            )
        else:
            raise SystemExit(f"--workloads: unknown {name!r} (known: {', '.join(WORKLOADS)})")
    return out


def save_random_model(args, folder: Path) -> Path:
    """The shape's random weights (seeded) and the test tokenizer, as a model directory; no
    EOS anywhere, so nothing stops early."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.testing import build_tiny_tokenizer

    config = model_config(args.shape)
    config.eos_token_id = config.bos_token_id = config.pad_token_id = None
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # random init on the GPU where there is one: faster
        model = AutoModelForCausalLM.from_config(config, dtype=args.torch_dtype)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    del model
    free_memory()
    return folder


# ---- the embedded engine ------------------------------------------------------------


def engine_config(args, model_dir: Path, sequences: int, longest: int):
    from asyncgrpo.base.config import EmbeddedEngineConfig

    return EmbeddedEngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        kv_cache="paged",  # the CUDA engine's layout; on a CPU with gathered keys
        max_num_seqs=sequences,
        max_model_len=max(longest + 1, 128),  # room for the warm-up's prompts too
        prefill_chunk_size=args.prefill_chunk,
        prefill_token_budget=args.prefill_budget,
        num_threads=args.threads,
    )


async def _submit(engine, jobs) -> int:
    """Every (prompt, sampling params) at once; the tokens generated."""

    async def one(prompt, params) -> int:
        count = 0
        async for delta in engine.generate(prompt, params):
            count += len(delta.token_ids)
        return count

    return sum(await asyncio.gather(*(one(prompt, params) for prompt, params in jobs)))


class EmbeddedSystem:
    """The engine, started once for every workload, warmed up with two rounds of other
    sizes (a compiled FlexAttention settles on symbolic sizes at its second shape)."""

    def __init__(self, args, model_dir: Path, works: list[Workload]):
        from asyncgrpo.inference.engine.engine import Engine

        sequences = min(args.max_num_seqs, max(len(w.rows()) for w in works))
        longest = max(w.summary()["longest"] for w in works)
        self.engine = Engine(engine_config(args, model_dir, sequences, longest))
        self.engine.start()
        self.vocab = self.engine.vocab_size
        room = self.engine.max_model_len - 12  # a warm-up prompt and its tokens fit
        try:
            for lengths in ((20, 40), (33, 70, 90)):
                jobs = [(self._prompt(min(n, room)), self._params(2 + n // 10)) for n in lengths]
                asyncio.run(_submit(self.engine, jobs))
        except BaseException:
            self.close()  # no one else holds it to stop its thread
            raise

    def _prompt(self, length: int) -> list[int]:
        return [(7 + 13 * i) % self.vocab for i in range(length)]

    @staticmethod
    def _params(max_tokens: int, n: int = 1):
        from asyncgrpo.inference.engine.types import SamplingParams

        return SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, ignore_eos=True)

    def run(self, work: Workload) -> dict:
        jobs = [(p, self._params(m, work.samples)) for p, m in zip(work.prompts, work.max_tokens)]
        busy = self.engine.busy_seconds
        start = time.perf_counter()
        tokens = asyncio.run(_submit(self.engine, jobs))
        seconds = time.perf_counter() - start
        return {"tokens": tokens, "seconds": seconds, "busy_s": self.engine.busy_seconds - busy}

    def close(self) -> None:
        self.engine.shutdown()
        self.engine = None


# ---- the run and its report -----------------------------------------------------------


def save(report: dict, out: Path) -> None:
    out.write_text(json.dumps(report, indent=1) + "\n")


def run_system(name: str, args, model_dir: Path, works: list[Workload], report: dict) -> None:
    """One system over every workload; whatever fails is recorded, the rest goes on."""
    builders = {"embedded": EmbeddedSystem, "generate": GenerateSystem}
    builders["continuous"] = ContinuousSystem
    system, results = None, report["results"]
    try:
        system = builders[name](args, model_dir, works)
        for work in works:
            results.append(_run_one(name, system, work, report))
            save(report, args.out)
    except Exception as exc:  # no such system here, or setting it up failed
        done = {r["workload"] for r in results if r["system"] == name}
        why = {"unavailable": str(exc)} if isinstance(exc, Unavailable) else {"error": repr(exc)}
        if not isinstance(exc, Unavailable):
            report["errors"].append(_failure(name, exc))
        for work in works:
            if work.name not in done:
                results.append({"system": name, "workload": work.name, **why})
    finally:
        if system is not None:
            system.close()
        del system
        free_memory()


def _run_one(name: str, system, work: Workload, report: dict) -> dict:
    """One system's figures on one workload, or the error that stopped it (an
    `Unavailable` goes up: the system is missing, not failing)."""
    try:
        figures = system.run(work)
    except Unavailable:
        raise
    except Exception as exc:  # this workload only
        report["errors"].append(_failure(f"{name}/{work.name}", exc))
        free_memory()
        return {"system": name, "workload": work.name, "error": repr(exc)}
    tok_s = figures["tokens"] / figures["seconds"]
    print(f"  {name:<11} {work.name:<8} {tok_s:10.1f} tok/s", flush=True)
    return {"system": name, "workload": work.name, **figures, "tok_s": tok_s}


def run_limit(args, model_dir: Path, report: dict) -> None:
    """The decode step against the device's limit (decode_limit.py), on the engine's
    own runner at `--limit-batches`."""
    batches = [int(b) for b in args.limit_batches.split(",")]
    grows = (args.limit_warmup + args.limit_steps) * len(batches)
    config = engine_config(args, model_dir, max(batches), args.limit_context + grows)
    try:
        report["limit"] = measure_limit(args, config, batches)
    except Exception as exc:  # the figures so far stay
        report["errors"].append(_failure("limit", exc))
        report["limit"] = {"error": repr(exc)}
    free_memory()


def _failure(label: str, exc: BaseException) -> str:
    traceback.print_exception(exc)
    return f"{label}: {type(exc).__name__}: {exc}"


def ratios(results: list[dict]) -> dict:
    tok = {(r["system"], r["workload"]): r.get("tok_s") for r in results}
    out = {}
    for workload in {r["workload"] for r in results}:
        mine = tok.get(("embedded", workload))
        out[workload] = {
            f"embedded/{other}": mine / tok[(other, workload)]
            if mine and tok.get((other, workload))
            else None
            for other in ("generate", "continuous")
        }
    return out


def print_table(report: dict) -> None:
    print(f"\n{report['shape']} on {report['device']}, {report['dtype']}")
    print(f"{'workload':<9} {'system':<11} {'tok/s':>9} {'seconds':>8}  vs generate  vs continuous")
    for r in report["results"]:
        if "tok_s" not in r:
            why = r.get("error") or r.get("unavailable")
            print(f"{r['workload']:<9} {r['system']:<11} {'-':>9}  {str(why)[:60]}")
            continue
        mine = report["ratios"].get(r["workload"], {}) if r["system"] == "embedded" else {}
        gen, cont = (mine.get(f"embedded/{o}") for o in ("generate", "continuous"))
        print(
            f"{r['workload']:<9} {r['system']:<11} {r['tok_s']:>9.1f} {r['seconds']:>8.2f}  "
            f"{_times(gen):>11}  {_times(cont):>13}"
        )
    limit = report.get("limit") or {}
    if "batches" in limit:
        print(
            f"copy {limit['copy_gb_s']:.1f} GB/s, bf16 matmul {limit['matmul_tflops']:.2f} TFLOP/s"
        )
        for row in limit["batches"]:
            print(
                f"decode batch {row['batch']}: step {row['step_ms']:.3f} ms (sampling "
                f"{row['sample_ms']:.3f}), limit {row['limit_ms']:.3f} ms (memory "
                f"{row['memory_ms']:.3f}, compute {row['compute_ms']:.3f}): {row['ratio']:.1f}x"
            )
    for error in report["errors"]:
        print("error:", error)


def compiled_graphs() -> dict:
    """torch.compile's counts so far (FlexAttention's graphs: a recompile per new shape
    until sizes turn symbolic; past torch's limit of 8 a kernel raises)."""
    from torch._dynamo.utils import counters

    return {key: int(value) for key, value in counters["stats"].items()}


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="auto: bfloat16 on cuda, float32 on a CPU")  # fmt: skip
    ap.add_argument("--systems", default=",".join(PHASES), help="systems, and `limit`")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nano-sequences", type=int, default=256)
    ap.add_argument("--nano-min", type=int, default=100)
    ap.add_argument("--nano-max", type=int, default=1024)
    ap.add_argument("--grpo-prompts", type=int, default=32)
    ap.add_argument("--grpo-samples", type=int, default=4)
    ap.add_argument("--grpo-prompt-len", type=int, default=64)
    ap.add_argument("--grpo-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch")
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--prefill-budget", type=int, default=8192)
    ap.add_argument("--generate-batch-size", type=int, default=0, help="0: one batch")
    ap.add_argument("--system-timeout", type=float, default=600.0, help="continuous, seconds")
    ap.add_argument("--limit-batches", default="64,256")
    ap.add_argument("--limit-context", type=int, default=1024, help="keys per sequence")
    ap.add_argument("--limit-warmup", type=int, default=3)
    ap.add_argument("--limit-steps", type=int, default=16)
    ap.add_argument("--copy-mib", type=int, default=None, help="default 1024 cuda, 64 cpu")
    ap.add_argument("--matmul-size", type=int, default=None, help="default 8192 cuda, 256 cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    ap.add_argument("--out", type=Path, default=SCRATCH / "gpu_engine.json")
    args = ap.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(PHASES)
    if unknown:
        ap.error(f"--systems: unknown {', '.join(sorted(unknown))} (known: {', '.join(PHASES)})")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if cuda else "cpu"
    args.dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    args.torch_dtype = getattr(torch, args.dtype)
    args.copy_mib = args.copy_mib or (1024 if cuda else 64)
    args.matmul_size = args.matmul_size or (8192 if cuda else 256)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        os.environ.setdefault(CUDA_GATE, "1")  # the engine's CUDA path is what this measures
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    )
    works = make_workloads(args, model_config(args.shape).vocab_size)
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("torch_dtype",)}
    report = {"settings": settings, "shape": args.shape, "device": device_name}
    report |= {"dtype": args.dtype, "workloads": {w.name: w.summary() for w in works}}
    report |= {"results": [], "ratios": {}, "limit": None, "compiled": {}, "errors": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-engine-") as scratch:
        model_dir = save_random_model(args, Path(scratch) / args.shape)
        for name in args.systems.split(","):
            if name == "limit":
                run_limit(args, model_dir, report)
            else:
                run_system(name, args, model_dir, works, report)
            report["ratios"] = ratios(report["results"])
            report["compiled"] = compiled_graphs()
            save(report, args.out)
    print_table(report)
    print(f"wrote {args.out}")
    write_result("gpu_engine", report, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
