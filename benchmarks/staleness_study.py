"""Does staleness cost learning? A grid of `asyncgrpo train` configurations over seeds,
each run scored afterwards on held-out rows by one evaluator.

A *cell* is a set of `--set` overrides on the recipe (task × staleness × correction × lr,
or a named fix); a *run* is a cell on one seed (and, for the noise measurement, one
repeat). Stages choose the cells:

    python benchmarks/staleness_study.py --stage noise              # st 0/1, 2 seeds × 2 repeats
    python benchmarks/staleness_study.py --stage grid --seeds 0,1,2,3,4,5
    python benchmarks/staleness_study.py --stage grid --tasks recipe --staleness 0,1 \\
        --corrections truncated_is --lrs 3e-5 --seeds 0,1,2,3,4,5   # the main question
    python benchmarks/staleness_study.py --stage precision --seeds 0,1,2,3,4,5
    python benchmarks/staleness_study.py --stage fix:lr-half --seeds 0,1,2,3,4,5
    python benchmarks/staleness_study.py --stage fix:m2 --staleness 1,4,16 --seeds 0,1,2,3,4,5,6,7
    python benchmarks/staleness_study.py --stage grid --report-only  # tables from disk

Corrections, as config fields (read off `trainer/losses.py` and `grpo_loss.py`):

- `none`: `trainer.old_logprobs=engine`, `loss.name=clipped`, `loss.correction=none`.
  The ratio is π_θ/π_engine, clipped to [1 − ε_low, 1 + ε_high]: a PPO trust region
  around the sampler, no behaviour weight. (With old = engine the anchor is the engine,
  so ρ = 1 and every correction mode is a no-op; demo.yaml runs this today.)
- `truncated_is` (the library's default): `trainer.old_logprobs=current`,
  `loss.name=clipped`, `loss.correction=token_truncate`, `loss.correction_cap=2.0`.
  π_old is π_θ detached, so the ratio is 1 in value and the clip never binds (clip
  fractions 0); each token's gradient is weighted by min(π_θ/π_engine, 2).
- `decoupled` (AReaL's decoupled PPO): `trainer.old_logprobs=current`,
  `loss.name=decoupled_ppo`, `loss.correction=none`. The train loop passes no proximal
  log-probs, so π_prox = π_old = π_θ detached (exact for one optimizer step per batch:
  AReaL's π_prox is the policy before the update). The ratio is 1, the clip inactive, and
  the behaviour weight π_prox/π_engine is kept uncapped ('raw'). With
  `loss.correction=token_truncate` it would equal `truncated_is` bit for bit: in
  `asyncgrpo train` decoupled PPO differs from truncated IS only by the cap.

Staleness k sets `coordinator.max_staleness=k` and `coordinator.max_ahead_batches=null`,
so the bound and not the look-ahead (default 1 batch, which holds every async run at ~1)
sets how old samples get; the realised token staleness is recorded per run.

Per run (`staleness_report.run_summary`): the training-reward area (mean `reward_mean`
over steps 1..N), the step and time at which the trailing 3-step mean reward reaches the
task's threshold, clip and mask fractions, IS-weight min/mean/max, realised token
staleness mean/max, `mismatch_kl`, wall seconds; then the held-out reward of the final
weights (greedy, `end_to_end.score_weights`, one engine for every run of a task and
seed). There is no metric of the KL between consecutive policies: `mismatch_kl` is
KL(π_engine‖π_θ), which at realised staleness exactly 1 is that KL plus the kernel
mismatch (the same metric at staleness 0). Measuring it directly needs one more forward
(no backward) of the step's batch after `optim_step`, about a third of a step's compute.

Resumable: a run with its result JSON (`<out>/results/<cell>/<run>.json`) is not rerun; a
run that finished training but was not scored is scored; any other run directory (an
interrupted run) is deleted and trained again. `--jobs 2` trains two runs at once with one
engine and one trainer thread each; `--jobs 1` one at a time with the recipe's threads
(or `--trainer-threads`). Each result records its wall seconds, jobs and threads.
Outputs per stage: `<out>/<stage>/study.json`, `study.md`, `study.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import result_files
from e2e_report import read_metrics, snapshots  # benchmarks/ is on sys.path
from end_to_end import drop_weights, finished, run_asyncgrpo, score_weights
from staleness_report import (
    add_paired_seeds_needed,
    cell_table,
    comparisons,
    markdown,
    noise_report,
    plot,
    run_summary,
)

ROOT = Path(__file__).resolve().parent.parent

CORRECTIONS = {
    "none": ["trainer.old_logprobs=engine", "loss.name=clipped", "loss.correction=none"],
    "truncated_is": [
        "trainer.old_logprobs=current",
        "loss.name=clipped",
        "loss.correction=token_truncate",
        "loss.correction_cap=2.0",
    ],
    "decoupled": [
        "trainer.old_logprobs=current",
        "loss.name=decoupled_ppo",
        "loss.correction=none",
    ],
}
"""Correction name -> the overrides that make it (module docstring)."""


@dataclass(frozen=True)
class Task:
    overrides: tuple[str, ...]
    threshold: float
    """Training reward the time-to-threshold is measured at (a trailing 3-step mean)."""


TASKS = {
    # the recipe's own task (demo.yaml: word_count, attractors at 0.6-0.95)
    "recipe": Task((), 0.7),
    # one answer per prompt, reward = correctness with a brevity gradient toward the bare
    # number: one optimum, no competing length attractors. templates=3: 300 problems (the
    # default 100 are too few to hold out 64). Base rate (64 held-out prompts x 8, bf16,
    # max_tokens 24, 2026-11-26): sampled 0.085, greedy 0.44, 78% of groups with variance.
    "arithmetic": Task(
        ("dataset.builtin=arithmetic", "dataset.templates=3", "rewards=[short_arithmetic_reward]"),
        0.5,
    ),
}

FIXES = {
    "lookahead": ["coordinator.max_ahead_batches=1.0"],  # the recipe's look-ahead, not null
    "lr-half": ["trainer.learning_rate=1.5e-05"],  # a step size scaled with staleness
    # the first grid's async runs stalled in steps 5-10, where the policy moves fastest
    "warmup": ["trainer.warmup_steps=8"],
    "token-mask": ["loss.correction=token_mask"],  # rejection instead of truncation
    "fp32-engine": ["engine.dtype=float32"],
    # AReaL's decoupled PPO: the behaviour weight uncapped (the `decoupled` correction)
    "decoupled": ["loss.name=decoupled_ppo", "loss.correction=none"],
    # M2PO: a bound on the batch's second moment of log(pi/pi_engine) instead of the clip
    "m2": ["loss.trust_region=m2"],
    # IcePop-style masked importance weights: rho inside [0.5, 5], no gradient outside
    "masked-is": ["loss.correction=masked_is"],
    "m2-masked-is": ["loss.trust_region=m2", "loss.correction=masked_is"],
}
"""Candidate fixes: extra overrides on the lr 3e-5 cells of the recipe's task, at each
staleness of `--staleness` above 0 (default 1 for a fix stage; 1,4,16 asks for the far
cells too), each compared with sync and with the unfixed cell of its staleness."""


@dataclass
class Cell:
    name: str
    task: str
    staleness: int
    overrides: list[str]
    compare_to: list[str] = field(default_factory=list)


def make_cell(task: str, staleness: int, correction: str, lr: float, suffix="", extra=()) -> Cell:
    name = f"{task}-st{staleness}-{correction}-lr{lr:g}{suffix}"
    overrides = [
        *TASKS[task].overrides,
        *CORRECTIONS[correction],
        f"trainer.learning_rate={lr:g}",
        "coordinator.max_ahead_batches=null",
        *extra,
    ]
    return Cell(name, task, staleness, overrides)


def grid(tasks, stalenesses, corrections, lrs) -> list[Cell]:
    """Every combination; each async cell is compared with its sync cell, and each
    correction with `none` at the same staleness."""
    cells = []
    for task in tasks:
        for lr in lrs:
            for k in stalenesses:
                for c in corrections:
                    cell = make_cell(task, k, c, lr)
                    if k > 0 and 0 in stalenesses:
                        cell.compare_to.append(make_cell(task, 0, c, lr).name)
                    if c != "none" and "none" in corrections:
                        cell.compare_to.append(make_cell(task, k, "none", lr).name)
                    cells.append(cell)
    return cells


def stage_cells(stage: str, args) -> list[Cell]:
    sync = make_cell("recipe", 0, "truncated_is", 3e-5)
    async1 = make_cell("recipe", 1, "truncated_is", 3e-5)
    async1.compare_to.append(sync.name)
    if stage == "noise":
        return [sync, async1]
    if stage == "grid":
        return grid(args.tasks, args.staleness, args.corrections, args.lrs)
    if stage == "precision":
        fp32 = make_cell("recipe", 0, "truncated_is", 3e-5, "-fp32engine", ["engine.dtype=float32"])
        fp32.compare_to.append(sync.name)
        return [sync, fp32]
    if stage.startswith("fix:") and stage[4:] in FIXES:
        return fix_cells(stage[4:], sync, [k for k in args.staleness if k > 0] or [1])
    known = ", ".join(["noise", "grid", "precision", *(f"fix:{f}" for f in FIXES)])
    raise SystemExit(f"unknown stage {stage!r}; known: {known}")


def fix_cells(name: str, sync: Cell, stalenesses: list[int]) -> list[Cell]:
    """Sync, then per staleness the unfixed async cell and the fixed one beside it."""
    cells = [sync]
    for k in stalenesses:
        plain = make_cell("recipe", k, "truncated_is", 3e-5)
        plain.compare_to.append(sync.name)
        fixed = make_cell("recipe", k, "truncated_is", 3e-5, f"-{name}", FIXES[name])
        fixed.compare_to += [sync.name, plain.name]
        cells += [plain, fixed]
    return cells


@dataclass
class Run:
    cell: Cell
    seed: int
    repeat: int
    out: Path

    @property
    def name(self) -> str:
        return f"seed{self.seed}" + (f"-r{self.repeat}" if self.repeat else "")

    @property
    def run_dir(self) -> Path:
        return self.out / "runs" / self.cell.name / self.name

    @property
    def result_path(self) -> Path:
        return self.out / "results" / self.cell.name / f"{self.name}.json"

    @property
    def wall_path(self) -> Path:
        return self.run_dir.parent / f"{self.name}.wall.json"


def held_out(seed: int, args) -> list[str]:
    """The seed and the held-out rows it keeps out of training (the same for every cell)."""
    return [f"seed={seed}", f"dataset.eval_size={args.held_out}"]


def run_overrides(run: Run, args) -> list[str]:
    """The cell's overrides plus what every run of the study shares: the seed, N steps,
    held-out rows kept out of training, a snapshot at step N, no in-run evaluation beyond
    the first, the threads `--jobs` implies."""
    threads = ["engine.num_threads=1", "trainer.num_threads=1"] if args.jobs > 1 else []
    if args.jobs == 1 and args.trainer_threads:
        threads = [f"trainer.num_threads={args.trainer_threads}"]
    return [
        *args.overrides,
        *run.cell.overrides,
        *held_out(run.seed, args),
        "eval_limit=1",
        "eval_steps=1000000",
        f"save_weights_steps={args.steps}",
        "checkpoint_steps=1000000",
        *threads,
    ]


def train(run: Run, args) -> bool:
    """Train one run (an interrupted one from scratch); record its wall seconds."""
    shutil.rmtree(run.run_dir, ignore_errors=True)
    run.run_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        run_asyncgrpo(
            args.recipe, run.run_dir.parent, run.name, run.cell.staleness,
            args.max_time_s, run_overrides(run, args), args.steps,
        )  # fmt: skip
    except subprocess.CalledProcessError as err:
        print(f"[{run.cell.name}/{run.name}] failed ({err.returncode}); see its log", flush=True)
        return False
    wall = {"wall_s": time.monotonic() - started, "jobs": args.jobs}
    run.wall_path.write_text(json.dumps(wall))
    return True


def train_pending(runs: list[Run], args) -> list[Run]:
    """Runs without a result: train those not finished, `--jobs` at a time; the trained."""
    pending = [r for r in runs if not r.result_path.exists()]
    to_train = [r for r in pending if not (finished(r.run_dir) and r.wall_path.exists())]
    print(f"{len(runs)} runs: {len(runs) - len(pending)} done, {len(to_train)} to train")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        ok = dict(zip(map(id, to_train), pool.map(lambda r: train(r, args), to_train)))
    return [r for r in pending if ok.get(id(r), True)]


def score(runs: list[Run], args) -> None:
    """Final weights of `runs` scored on their held-out rows: one engine per task and seed
    (the held-out rows depend on both); each run's result JSON written."""
    from asyncgrpo.base.config import load_config
    from asyncgrpo.learning.rollout.data import load_prompts

    groups: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.cell.task, run.seed), []).append(run)
    for (task, seed), members in groups.items():
        # the evaluator is the recipe's, on the task: no cell's precision or loss reaches it
        cfg = load_config(
            args.recipe, [*args.overrides, *TASKS[task].overrides, *held_out(seed, args)]
        )
        _, rows = load_prompts(cfg.dataset, cfg.seed)
        files = [snapshots(r.run_dir)[-1][2] for r in members]
        print(f"[{task} seed {seed}] scoring {len(files)} runs on {len(rows)} held-out rows")
        scores = asyncio.run(score_weights(cfg, files, rows, args.score_threads))
        for run, per_prompt in zip(members, scores[1:], strict=True):
            write_result(run, args, scores[0], per_prompt)
        if not args.keep_weights:
            drop_weights({f"{r.cell.name}/{r.name}": r.run_dir for r in members})


def write_result(run: Run, args, initial: list[float], final: list[float]) -> None:
    train_rows, _ = read_metrics(run.run_dir)
    result = {
        "cell": run.cell.name,
        "task": run.cell.task,
        "staleness": run.cell.staleness,
        "seed": run.seed,
        "repeat": run.repeat,
        "overrides": run_overrides(run, args),
        **json.loads(run.wall_path.read_text()),
        "summary": run_summary(
            train_rows, args.steps, args.threshold or TASKS[run.cell.task].threshold
        ),
        "held_out_initial": sum(initial) / len(initial),
        "held_out_final": sum(final) / len(final),
        "held_out_per_prompt": final,
        "run_dir": str(run.run_dir),
    }
    run.result_path.parent.mkdir(parents=True, exist_ok=True)
    run.result_path.write_text(json.dumps(result, indent=1))


def refresh_summary(result: dict, args) -> None:
    """Recompute a result's summary from its run's metrics, where they are on disk."""
    run_dir = Path(result["run_dir"])
    if (run_dir / "metrics.jsonl").exists():
        threshold = args.threshold or TASKS[result["task"]].threshold
        result["summary"] = run_summary(read_metrics(run_dir)[0], args.steps, threshold)


def report(stage: str, cells: list[Cell], args) -> dict:
    """The stage's JSON, markdown table and figure, from every result on disk."""
    results = [json.loads(p.read_text()) for p in sorted((args.out / "results").rglob("*.json"))]
    for result in results:  # summaries follow the report's code, not the code that ran
        refresh_summary(result, args)
    names = {c.name for c in cells}
    mine = [r for r in results if r["cell"] in names]
    table = cell_table(mine)
    pairs = [
        (c.name, ref) for c in cells for ref in c.compare_to if c.name in table and ref in table
    ]
    diffs = comparisons(mine, pairs)
    noise = noise_report(results)  # every cell with repeats or several seeds tells the noise
    add_paired_seeds_needed(noise, diffs)
    folder = args.out / stage.replace(":", "-")
    folder.mkdir(parents=True, exist_ok=True)
    summary = {
        "stage": stage,
        "steps": args.steps,
        "cells": table,
        "differences": diffs,
        "noise": noise,
    }
    (folder / "study.json").write_text(json.dumps(summary, indent=1))
    (folder / "study.md").write_text(markdown(stage, args.steps, table, diffs, noise))
    if table:
        plot(table, folder / "study.png", f"{Path(args.recipe).stem}, stage {stage}")
    print((folder / "study.md").read_text())
    return summary


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", required=True, help="noise, grid, precision or fix:<name>")
    p.add_argument("--recipe", default="recipes/demo.yaml")
    p.add_argument("--seeds", type=csv(int), default=None, help="default: 0,1 (noise), 0-5")
    p.add_argument("--repeats", type=int, default=None, help="runs per seed (default: 2 noise, 1)")
    p.add_argument("--steps", type=int, default=24, help="N: optimizer steps per run")
    p.add_argument("--tasks", type=csv(str), default=list(TASKS))
    p.add_argument("--staleness", type=csv(int), default=None, help="default: 0,1,2,4 (grid), 1")
    p.add_argument("--corrections", type=csv(str), default=list(CORRECTIONS))
    p.add_argument("--lrs", type=csv(float), default=[1e-5, 3e-5])
    p.add_argument("--jobs", type=int, choices=(1, 2), default=1)
    p.add_argument("--trainer-threads", type=int, default=None, help="with --jobs 1")
    p.add_argument("--held-out", type=int, default=64, help="held-out rows scored per run")
    p.add_argument("--score-threads", type=int, default=2)
    p.add_argument("--threshold", type=float, default=None, help="default: per task")
    p.add_argument("--max-time-s", type=float, default=3600.0, help="per-run safety stop")
    p.add_argument("--keep-weights", action="store_true")
    p.add_argument("--report-only", action="store_true", help="tables from the results on disk")
    p.add_argument("--out", default="runs/benchmarks/staleness")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="on every run")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, known in (("tasks", TASKS), ("corrections", CORRECTIONS)):
        unknown = set(getattr(args, name)) - set(known)
        if unknown:
            parser.error(f"unknown {name} {sorted(unknown)} (known: {', '.join(known)})")
    noise = args.stage == "noise"
    args.seeds = args.seeds or ([0, 1] if noise else list(range(6)))
    args.repeats = args.repeats or (2 if noise else 1)
    args.staleness = args.staleness or ([1] if args.stage.startswith("fix:") else [0, 1, 2, 4])
    args.out = (ROOT / args.out).resolve()
    cells = stage_cells(args.stage, args)
    runs = [
        Run(cell, seed, repeat, args.out)
        for seed in args.seeds
        for repeat in range(args.repeats)
        for cell in cells
    ]
    if not args.report_only:
        score(train_pending(runs, args), args)
    result_files.write_result("staleness_study", report(args.stage, cells, args), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
