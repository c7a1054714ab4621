"""The planner against published systems: predict a reported async-over-sync speedup.

    PYTHONPATH=src python benchmarks/plan_published.py [--steps 10]

Each row takes a published configuration (model, devices and their split, lengths cap,
batch, staleness), the cost models in `benchmarks/plan_published/` (every input with its
source), and predicts the synchronous and the asynchronous step with the planner
(`asyncgrpo.plan.predict`, the code behind `asyncgrpo plan`). The data-sheet rows use
only the YAML; the "published phases" row replaces its trainer and decode costs with the
phase times of verl's *synchronous* runs (128 and 64 GPUs) and predicts the
asynchronous one, so nothing is fitted to the number it predicts. Prints a markdown
table (docs/benchmarks/planner.md, "Against published systems").
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from asyncgrpo.plan import Costs, Deployment, Lengths, predict
from asyncgrpo.plan.costs import load_cost_model

HERE = Path(__file__).parent / "plan_published"
BATCH = dict(batch_groups=512, num_generations=16)  # 512 prompts x 16 (both systems)

# verl docs, fully_async_policy, "Asynchronous Training on 7B Model" (H20): phase times
VERL_SYNC_128 = {"step": 356.30, "gen": 177.85, "old_log_prob": 53.92, "update_actor": 113.81}
VERL_SYNC_64_UPDATE_ACTOR = 133.41


@dataclass
class Case:
    system: str
    config: str
    costs_file: str
    sync: Deployment
    asynchronous: Deployment
    reported: float  # async-over-sync speedup as published
    reported_steps: tuple[float, float]  # (sync, async) seconds per step as published
    published_phases: bool = False


def verl_layouts() -> tuple[Deployment, Deployment]:
    sync = Deployment(engines=32, trainer_ranks=128, max_staleness=0, max_num_seqs=256,
                      colocated=True, logprob_pass=True, **BATCH)  # fmt: skip
    # staleness_threshold 0.5: at most 1.5 batches generated ahead of the trainer; partial
    # rollout drops the KV cache on sync (vLLM sleep), so running requests prefill again
    asynchronous = Deployment(engines=16, trainer_ranks=64, max_staleness=2,
                              max_ahead_batches=1.5, sync_mode="abort", max_num_seqs=256,
                              **BATCH)  # fmt: skip
    return sync, asynchronous


def areal_layouts(gpus: int, max_num_seqs: int) -> tuple[Deployment, Deployment]:
    engines, ranks = gpus * 3 // 4, gpus // 4
    common = dict(engines=engines, trainer_ranks=ranks, max_ahead_batches=None,
                  sync_mode="abort", max_num_seqs=max_num_seqs, logprob_pass=True, **BATCH)  # fmt: skip
    return Deployment(max_staleness=0, **common), Deployment(max_staleness=4, **common)


def cases() -> list[Case]:
    verl = verl_layouts()
    verl_steps = (356.30, 150.63)
    return [
        Case("verl fully_async", "Qwen2.5-Math-7B, 128 H20: colocated sync vs 64 rollout + 64 train",
             "verl_fully_async_7b.yaml", *verl, 2.35, verl_steps),
        Case("verl fully_async", "same, trainer and decode costs from the published sync phases",
             "verl_fully_async_7b.yaml", *verl, 2.35, verl_steps, published_phases=True),
        Case("AReaL", "R1-Distill-Qwen-1.5B, 16 nodes H800 (96 SGLang + 32 train), eta 4 vs 0",
             "areal_15b.yaml", *areal_layouts(128, 200), 41.0 / 14.8, (147.6, 53.3)),
        Case("AReaL", "R1-Distill-Qwen-7B, 24 nodes H800 (144 SGLang + 48 train), eta 4 vs 0",
             "areal_7b.yaml", *areal_layouts(192, 70), 57.7 / 25.4, (207.7, 91.4)),
    ]  # fmt: skip


def generate_s(layout: Deployment, costs: Costs, lengths: Lengths, steps: int) -> float:
    """A synchronous step's generation time: the time the trainer idles in it."""
    p = predict(layout, costs, lengths, steps=steps, warmup=2)
    return p.step_s * p.trainer_idle


def from_published_phases(costs: Costs, lengths: Lengths, sync: Deployment, steps: int) -> Costs:
    """verl's costs from its synchronous runs' phase times (none from the asynchronous one).

    Trainer: update_actor on 128 GPUs and on 64 GPUs give the rank scaling; the 128-GPU
    update_actor and old_log_prob over the step's tokens give the per-token costs.
    Decode: the data-sheet law scaled until the 128-GPU colocated generation takes the
    published `gen` time.
    """
    tokens = (
        sync.batch_groups
        * sync.num_generations
        * (np.mean(lengths.completions) + lengths.prompt_tokens)
    )
    efficiency = VERL_SYNC_64_UPDATE_ACTOR / VERL_SYNC_128["update_actor"] / 2
    fitted = replace(costs, rank_efficiency=efficiency)
    speedup = fitted.rank_speedup(sync.trainer_ranks)
    fitted = replace(
        fitted,
        train_per_token_s=VERL_SYNC_128["update_actor"] * speedup / tokens,
        logprob_per_token_s=VERL_SYNC_128["old_log_prob"] * speedup / tokens,
    )
    for _ in range(3):  # generation time is close to proportional to the decode scale
        scale = VERL_SYNC_128["gen"] / generate_s(sync, fitted, lengths, steps)
        fitted = replace(
            fitted,
            decode_base_s=fitted.decode_base_s * scale,
            decode_per_seq_s=fitted.decode_per_seq_s * scale,
            decode_per_ctx_s=fitted.decode_per_ctx_s * scale,
            prefill_per_token_s=fitted.prefill_per_token_s * scale,
        )
    return fitted


def run(case: Case, steps: int) -> dict:
    costs, lengths = load_cost_model(HERE / case.costs_file)
    if case.published_phases:
        costs = from_published_phases(costs, lengths, case.sync, steps)
    sync = predict(case.sync, costs, lengths, steps=steps, warmup=2)
    asynchronous = predict(case.asynchronous, costs, lengths, steps=steps, warmup=2)
    predicted = sync.step_s / asynchronous.step_s
    return {
        "case": case,
        "sync_s": sync.step_s,
        "async_s": asynchronous.step_s,
        "async_trainer_idle": asynchronous.trainer_idle,
        "predicted": predicted,
        "error": predicted / case.reported - 1,
        "rank_efficiency": costs.rank_efficiency,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps simulated")
    args = parser.parse_args()
    print("| system | configuration | reported sync / async s per step | predicted | "
          "reported speedup | predicted | error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for case in cases():
        r = run(case, args.steps)
        s, a = case.reported_steps
        print(
            f"| {case.system} | {case.config} | {s:.1f} / {a:.1f} | "
            f"{r['sync_s']:.1f} / {r['async_s']:.1f} | {case.reported:.2f}x | "
            f"{r['predicted']:.2f}x | {r['error']:+.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
