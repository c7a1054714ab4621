"""`asyncgrpo plan`: predict a grid of layouts from a run directory or a cost model.

    asyncgrpo plan --from runs/demo --engines 1,2 --staleness 0,1,2
    asyncgrpo plan --costs cluster.yaml --engines 4,8,16 --trainer-ranks 4,8 --budget 24
    asyncgrpo plan --from runs/demo --engines 1,2 --shared-cores 2   # replicas on the laptop

With `--from`, every axis not given keeps the run's own value; `--json` writes every
row, `--plot` draws the fastest layout's predicted timeline.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from asyncgrpo.plan.calibrate import calibrate
from asyncgrpo.plan.costs import PlanInputError, load_cost_model
from asyncgrpo.plan.grid import evaluate, fastest, layouts, table
from asyncgrpo.plan.simulate import Deployment


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _aheads(text: str) -> list[float | None]:
    return [None if v.strip().lower() == "none" else float(v) for v in text.split(",")]


def _modes(text: str) -> list[str]:
    modes = [v.strip() for v in text.split(",")]
    bad = [m for m in modes if m not in ("keep", "abort", "wait")]
    if bad:
        raise argparse.ArgumentTypeError(f"sync modes are keep, abort, wait (not {bad})")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncgrpo plan", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="run_dir", type=Path, help="calibrate from this run")
    source.add_argument("--costs", type=Path, help="a YAML cost model (docs/planner.md)")
    p.add_argument("--engines", type=_ints, help="engine replicas, e.g. 1,2,4")
    p.add_argument("--trainer-ranks", type=_ints, help="trainer processes, e.g. 1,2")
    p.add_argument("--staleness", type=_ints, help="coordinator.max_staleness values")
    p.add_argument("--max-ahead-batches", type=_aheads, help="e.g. 1,none")
    p.add_argument("--batch-groups", type=_ints, help="coordinator.batch_groups values")
    p.add_argument("--num-generations", type=_ints, help="rollout.num_generations values")
    p.add_argument("--sync-mode", type=_modes, help="keep,abort,wait")
    p.add_argument("--max-num-seqs", type=int, help="engine slot limit (default: the run's)")
    p.add_argument("--gpus-per-engine", type=int, default=1, help="devices one replica uses")
    p.add_argument("--colocated", action="store_true",
                   help="synchronous baseline on one pool: engines generate, then the same devices train")  # fmt: skip
    p.add_argument("--logprob-pass", action="store_true",
                   help="the trainer recomputes old log-probs before each update (logprob_per_token_s)")  # fmt: skip
    p.add_argument("--shared-cores", type=float,
                   help="engines and trainer share this many cores on one host (a laptop, a CPU node)")  # fmt: skip
    p.add_argument("--engine-threads", type=int, help="with --shared-cores (default: the run's)")
    p.add_argument("--trainer-threads", type=int, help="with --shared-cores (default: the run's)")
    p.add_argument("--budget", type=int, help="most devices (engines and trainer ranks)")
    p.add_argument("--decode-batch-half", type=float, default=16.0,
                   help="--from: batch at which a decode step's fixed and per-sequence costs are equal")  # fmt: skip
    p.add_argument("--steps", type=int, default=40, help="optimizer steps simulated per layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every row (and the fastest) here")
    p.add_argument("--plot", type=Path, help="draw the fastest layout's timeline (PNG)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.run_dir is not None:
            costs, lengths, base = calibrate(args.run_dir, decode_batch_half=args.decode_batch_half)
        else:
            (costs, lengths), base = load_cost_model(args.costs), Deployment()
    except PlanInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_num_seqs:
        base = replace(base, max_num_seqs=args.max_num_seqs)
    base = replace(base, colocated=args.colocated, logprob_pass=args.logprob_pass)
    if args.shared_cores is not None:
        if args.shared_cores <= 0:
            print("error: --shared-cores must be positive", file=sys.stderr)
            return 2
        base = replace(base, shared_cores=args.shared_cores)
    for name in ("engine_threads", "trainer_threads"):
        if getattr(args, name):
            base = replace(base, **{name: getattr(args, name)})
    axes = {
        "engines": args.engines,
        "trainer_ranks": args.trainer_ranks,
        "max_staleness": args.staleness,
        "max_ahead_batches": args.max_ahead_batches,
        "batch_groups": args.batch_groups,
        "num_generations": args.num_generations,
        "sync_mode": args.sync_mode,
    }
    grid = layouts(base, axes)
    if not grid:
        print(
            "error: no layout in the grid (weight_sync_steps needs more staleness;"
            " --colocated needs --staleness 0)",
            file=sys.stderr,
        )
        return 2
    rows = evaluate(
        grid, costs, lengths, gpus_per_engine=args.gpus_per_engine, seed=args.seed, steps=args.steps
    )
    print(table(rows))
    best = fastest(rows, args.budget)
    budget = "" if args.budget is None else f" within {args.budget} devices"
    print(f"\nfastest{budget}: " + ("none fits" if best is None else table([best]).splitlines()[1]))
    if args.json:
        out = {
            "costs": vars(costs),
            "rows": [c.row() for c in rows],
            "fastest": best and best.row(),
        }
        args.json.write_text(json.dumps(out, indent=1, default=float))
    if args.plot and best is not None:
        from asyncgrpo.plan.timeline import draw_timeline

        draw_timeline(best.prediction.timeline, args.plot, title=table([best]).splitlines()[1])
    return 0
