"""LoRA against full fine-tuning: what a sync publishes, and what a trainer step costs.

For each mode (`full`: every weight trains; `lora`: an adapter, default r=16 on
q/k/v/o) one fresh process loads the model in fp32, builds a `PolicyTrainer` with the
recipe defaults, and measures:

- published bytes per sync: `PolicyTrainer.named_weights` in the engine's weight dtype
  (`engine.dtype: auto`, as `asyncgrpo train` syncs), and the time to gather them (the
  copies made before a sync; median of `--gathers`);
- trainer step time: median wall and CPU time of `--steps` `PolicyTrainer.step`s on the
  same synthetic groups (after one warm-up step), `--groups` x `--group-size` samples of
  about `--prompt-len` + `--completion-len` tokens of random ids;
- peak RSS of the steps: `ru_maxrss` with the peak reset after loading the model
  (`/proc/self/clear_refs`), so loading spikes do not count; it holds the weights, the
  gradients, the optimizer state and the activations. "step Δ" is peak minus the RSS
  after loading (weights resident);
- end-to-end sync seconds (`--syncs`, 0 to skip): `EmbeddedBackend.sync_weights` (pause,
  transfer through `engine.weight_transport`, resume) to a real `asyncgrpo serve` child
  on the same model, median after one warm-up sync (for LoRA the engine keeps a copy of
  the base weights at the first adapter sync, then merges W + B @ A at each).

Each mode runs in its own process, so peaks do not mix; the engine child is started
only after the steps are timed, so it does not compete with them for the CPU.

    .venv/bin/python benchmarks/lora.py
    .venv/bin/python benchmarks/lora.py --modes lora --r 8 --targets all-linear --syncs 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

RESULTS = SCRATCH / "lora.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="name for asyncgrpo.base.models")
    ap.add_argument("--modes", default="full,lora", help="comma-separated: full, lora")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="or all-linear")
    ap.add_argument("--groups", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--completion-len", type=int, default=152, help="mean; ±16 per sample")
    ap.add_argument("--steps", type=int, default=5, help="timed trainer steps")
    ap.add_argument("--gathers", type=int, default=5, help="timed gathers of the weights")
    ap.add_argument("--syncs", type=int, default=5, help="timed syncs to an engine (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def make_groups(args, vocab: int):
    """GRPO-shaped groups of random token ids with rewards that vary inside each group."""
    from asyncgrpo.learning.rollout.types import Group, Rollout

    rng = random.Random(args.seed)
    groups = []
    for g in range(args.groups):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        rollouts = []
        for i in range(args.group_size):
            n = args.completion_len + rng.randint(-16, 16)
            completion = [rng.randrange(vocab) for _ in range(n)]
            reward = [float(i % 2)]
            rollouts.append(Rollout(prompt, completion, [-2.0] * n, [0] * n, "stop", "", reward))
        groups.append(Group(g, {}, rollouts))
    return groups


def build_trainer(args, model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from asyncgrpo.base.config import AdvantageConfig, LoraConfig, LossConfig, TrainerConfig
    from asyncgrpo.learning.trainer.lora import apply_lora
    from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.worker == "lora":
        targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
        model = apply_lora(model, LoraConfig(r=args.r, alpha=args.alpha, target_modules=targets))
    trainer_cfg = TrainerConfig(num_threads=args.threads)
    trainer = PolicyTrainer(model, trainer_cfg, LossConfig(), AdvantageConfig(), max_steps=1000)
    return trainer, trainer_cfg.use_bf16_autocast()


def time_steps(trainer, groups, count: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of `count` steps (after one warm-up step)."""
    trainer.step(groups)
    walls, cpus = [], []
    for _ in range(count):
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.step(groups)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def time_gathers(trainer, dtype, count: int) -> tuple[list[float], int, int]:
    """Seconds per gather of the published tensors, their bytes and their number."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        weights = list(trainer.named_weights(dtype))
        times.append(time.perf_counter() - start)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    return times, nbytes, len(weights)


async def time_syncs(args, trainer, model_dir: Path, dtype, count: int) -> dict:
    """Seconds per `sync_weights` to a real embedded engine, and the transfer step's."""
    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.inference.backend.embedded import EmbeddedBackend

    cfg = EmbeddedEngineConfig(model=str(model_dir), num_threads=args.engine_threads)
    backend = EmbeddedBackend(cfg)
    try:
        await backend.wait_ready(list(trainer.named_weights(dtype)))
        walls, transfers = [], []
        for version in range(count + 1):  # the first is a warm-up
            weights = list(trainer.named_weights(dtype))
            start = time.perf_counter()
            await backend.sync_weights(weights, version + 1, "keep")
            if version:
                walls.append(time.perf_counter() - start)
                transfers.append(backend.sync_timings["transfer_s"])
        return dict(sync_s=walls, transfer_s=transfers, transport=cfg.weight_transport)
    finally:
        await backend.close()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> None:
    """Make `ru_maxrss` count from now (Linux >= 4.0: "5" resets the peak RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_worker(args) -> dict:
    import torch

    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.base.models import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    trainer, autocast = build_trainer(args, model_dir)
    dtype = getattr(torch, EmbeddedEngineConfig().resolved_dtype())
    groups = make_groups(args, trainer.model.config.vocab_size)
    with torch.no_grad():
        sum(float(p.sum()) for p in trainer.model.parameters())  # page mmap-loaded weights in
    loaded_rss = rss_mb()
    reset_peak_rss()
    walls, cpus = time_steps(trainer, groups, args.steps)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB
    gathers, nbytes, tensors = time_gathers(trainer, dtype, args.gathers)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = dict(
        mode=args.worker,
        bf16_autocast=autocast,
        sync_dtype=str(dtype).removeprefix("torch."),
        trainable_params=trained,
        tokens_per_step=sum(
            len(r.prompt_ids) + len(r.completion_ids) for g in groups for r in g.rollouts
        ),
        published_bytes=nbytes,
        published_tensors=tensors,
        gather_s=gathers,
        step_s=walls,
        step_cpu_s=cpus,
        loaded_rss_mb=loaded_rss,
        peak_rss_mb=peak_rss,
    )
    if args.syncs:
        result.update(asyncio.run(time_syncs(args, trainer, model_dir, dtype, args.syncs)))
    return result


def run_mode(argv: list[str], mode: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(run: dict) -> dict:
    median = statistics.median
    summary = dict(
        run,
        median_gather_s=median(run["gather_s"]),
        median_step_s=median(run["step_s"]),
        median_step_cpu_s=median(run["step_cpu_s"]),
        step_delta_mb=run["peak_rss_mb"] - run["loaded_rss_mb"],
    )
    if "sync_s" in run:
        summary.update(
            median_sync_s=median(run["sync_s"]), median_transfer_s=median(run["transfer_s"])
        )
    return summary


def print_table(results: list[dict]) -> None:
    syncs = all("median_sync_s" in r for r in results)
    header = (
        f"{'mode':<6}{'trainable':>12}{'sync MB':>10}{'tensors':>8}{'gather s':>10}"
        f"{'step s':>8}{'CPU s':>7}{'peak RSS MB':>12}{'step Δ MB':>10}"
    )
    print(header + (f"{'sync s':>8}{'transfer s':>11}" if syncs else ""))
    for r in results:
        line = (
            f"{r['mode']:<6}{r['trainable_params']:>12,}{r['published_bytes'] / 2**20:>10.2f}"
            f"{r['published_tensors']:>8}{r['median_gather_s']:>10.4f}{r['median_step_s']:>8.2f}"
            f"{r['median_step_cpu_s']:>7.2f}{r['peak_rss_mb']:>12.0f}{r['step_delta_mb']:>10.0f}"
        )
        if syncs:
            line += f"{r['median_sync_s']:>8.3f}{r['median_transfer_s']:>11.3f}"
        print(line)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    load_before = os.getloadavg()
    results = []
    for mode in args.modes.split(","):
        results.append(summarize(run_mode(argv, mode)))
        print(f"{mode}: done", flush=True)
    first = results[0]
    print(
        f"model {args.model}, {first['tokens_per_step']} tokens per step, trainer threads "
        f"{args.threads}, bf16 autocast {first['bf16_autocast']}, sync dtype {first['sync_dtype']}"
    )
    print_table(results)
    report = dict(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        results=results,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    write_result("lora", report, argv)


if __name__ == "__main__":
    main()
