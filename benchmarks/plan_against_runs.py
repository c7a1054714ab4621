"""The planner against runs on this machine: calibrate on one run, predict others.

Trains the recipe four ways, one run after another (synchronous, staleness 1 — the
calibration run —, staleness 2 without the look-ahead cap, two engine replicas at
staleness 1), fits the planner's costs from the staleness-1 run (`asyncgrpo plan
--from`), predicts each layout, and compares with what each run measured over its steady
state (steps `--from-step`..N): samples trained per second from `time_s`, and the mean
`trainer_idle_ratio`. In-run evaluation is off after the first, so the measured time
holds only what the model holds.

With `--shared-cores` (default: this machine's cores) the prediction puts the engines and
the trainer on one host's cores (`plan/host.py`); `--shared-cores 0` gives each role its
own device, the model's default.

    python benchmarks/plan_against_runs.py [--recipe recipes/demo.yaml] [--steps 14]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from e2e_report import read_metrics  # benchmarks/ is on sys.path
from end_to_end import drop_weights, run_asyncgrpo
from result_files import SCRATCH, write_result

from asyncgrpo.plan import predict
from asyncgrpo.plan.calibrate import calibrate

ROOT = Path(__file__).resolve().parent.parent

# name -> (max_staleness, extra overrides, planner layout changes)
RUNS = {
    "staleness 0 (sync)": (0, [], {"max_staleness": 0}),
    "staleness 1 (calibration run)": (1, [], {}),
    "staleness 2, no look-ahead cap": (
        2,
        ["coordinator.max_ahead_batches=null"],
        {"max_staleness": 2, "max_ahead_batches": None},
    ),
    "two engine replicas, staleness 1": (1, ["engine.replicas=2"], {"engines": 2}),
}
CALIBRATION = "staleness 1 (calibration run)"


def measured(run_dir: Path, from_step: int, samples_per_step: int) -> dict:
    train, _ = read_metrics(run_dir)
    by_step = {r["step"]: r for r in train}
    last = max(by_step)
    if from_step - 1 not in by_step or last <= from_step:
        raise SystemExit(f"{run_dir}: too few steps for a steady state from step {from_step}")
    window = by_step[last]["time_s"] - by_step[from_step - 1]["time_s"]
    steady = [by_step[s] for s in range(from_step, last + 1)]
    return {
        "samples_per_s": (last - from_step + 1) * samples_per_step / window,
        "trainer_idle": statistics.mean(r.get("trainer_idle_ratio", 0.0) for r in steady),
    }


def slug(name: str) -> str:
    return "plan-" + "".join(c if c.isalnum() else "-" for c in name.split(",")[0]).strip("-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/demo.yaml")
    p.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    p.add_argument("--from-step", type=int, default=5, help="first step of the steady state")
    p.add_argument("--shared-cores", type=float, default=float(os.cpu_count() or 1))
    p.add_argument("--out", type=Path, default=SCRATCH / "plan_runs")
    p.add_argument("--reuse", action="store_true", help="keep runs already on disk")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="on every run")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    every = ["eval_limit=1", "eval_steps=1000000", "checkpoint_steps=1000000", *args.overrides]
    dirs = {}
    for name, (staleness, extra, _) in RUNS.items():
        run_dir = args.out / slug(name)
        if not (args.reuse and (run_dir / "metrics.jsonl").exists()):
            run_asyncgrpo(
                args.recipe, args.out, slug(name), staleness, 3600.0, [*every, *extra], args.steps
            )
            drop_weights({name: run_dir})  # the final checkpoint: 1.6 GB for SmolLM2
        dirs[name] = run_dir
    costs, lengths, base = calibrate(dirs[CALIBRATION])
    if args.shared_cores > 0:
        base = replace(base, shared_cores=args.shared_cores)
    per_step = base.batch_groups * base.num_generations
    rows = []
    for name, (_, _, change) in RUNS.items():
        got = measured(dirs[name], args.from_step, per_step)
        want = predict(replace(base, **change), costs, lengths, steps=40, warmup=8)
        rows.append(
            {
                "run": name,
                "measured_samples_per_s": got["samples_per_s"],
                "predicted_samples_per_s": want.samples_per_s,
                "error": want.samples_per_s / got["samples_per_s"] - 1,
                "measured_trainer_idle": got["trainer_idle"],
                "predicted_trainer_idle": want.trainer_idle,
            }
        )
    print(f"\ncalibrated on {dirs[CALIBRATION]}; shared cores {args.shared_cores or 'none'}")
    print("| run | measured samples/s | predicted | error | measured trainer idle | predicted |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['measured_samples_per_s']:.2f} | "
            f"{r['predicted_samples_per_s']:.2f} | {r['error']:+.1%} | "
            f"{r['measured_trainer_idle']:.3f} | {r['predicted_trainer_idle']:.2f} |"
        )
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "costs": vars(costs), "rows": rows}
    (args.out / "plan_against_runs.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out / 'plan_against_runs.json'}")
    write_result("plan_against_runs", out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
