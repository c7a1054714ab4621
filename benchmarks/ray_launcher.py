"""The Ray launcher's overhead against the local one, on the demo recipe.

Runs `asyncgrpo train recipes/demo.yaml` (SmolLM2-135M on the CPU) with
`--steps` optimizer steps under four launchers, interleaved `--repeats` times:

- `local`: everything on this machine, as `make demo` runs it;
- `ray (new)`: `cluster.launcher=ray` with no address, so the run starts its own
  Ray instance (what a laptop user gets); the engine shares the driver's node: shm;
- `ray (same node)`: joining a running two-node Ray cluster (started here with
  `ray.cluster_utils.Cluster`), the engine placed on the driver's node: shm;
- `ray (other node)`: the same cluster, the engine on the other node: weights by http.

Start-up is the wall time from launching the command until its first optimizer step
is logged; samples/s is completions trained per second of run clock between the
first and the last step; sync is the median `weight_sync_s` of the steps (the
trainer's wait for a weight sync). Medians over the repeats. All nodes share this
machine's two cores, so "other node" measures the transport, not a network.

    .venv/bin/python benchmarks/ray_launcher.py                 # 10 steps, 2 repeats
    .venv/bin/python benchmarks/ray_launcher.py --steps 4 --repeats 1
    .venv/bin/python benchmarks/ray_launcher.py --launchers local --recipe R.yaml --steps 2

`--launchers` picks a subset (the two-node cluster starts only for the attached ones);
`--recipe` and `--set` change the run, e.g. to a tiny model for a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = SCRATCH / "ray_launcher.json"
LAUNCHERS = ("local", "ray (new)", "ray (same node)", "ray (other node)")
ATTACHED = ("ray (same node)", "ray (other node)")  # they join the two-node cluster


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes/demo.yaml")
    ap.add_argument(
        "--launchers",
        default=",".join(LAUNCHERS),
        help=f"comma-separated subset of: {', '.join(LAUNCHERS)}",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    unknown = set(args.launchers) - set(LAUNCHERS)
    if unknown or not args.launchers:
        ap.error(f"--launchers: unknown {sorted(unknown)}; choose from {', '.join(LAUNCHERS)}")
    return args


def train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if x.get("kind") == "train"]


def run_once(args, name: str, overrides: list[str], work: Path) -> dict:
    """One `asyncgrpo train` of the recipe; its start-up and samples/s."""
    run_dir = work / name
    sets = [*args.overrides, f"max_steps={args.steps}", f"output_dir={work}", f"name={name}"]
    sets += overrides
    command = [sys.executable, "-m", "asyncgrpo.cli", "train", str(args.recipe)]
    for item in sets:
        command += ["--set", item]
    log = open(work / f"{name}.log", "wb")
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    first_step = None
    while proc.poll() is None:
        if first_step is None and train_rows(run_dir):
            first_step = time.monotonic() - start
        time.sleep(0.1)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}); see {work / name}.log")
    rows = train_rows(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    per_step = cfg["rollout"]["num_generations"] * cfg["coordinator"]["batch_groups"]
    span = rows[-1]["time_s"] - rows[0]["time_s"]
    placed = run_dir / "cluster.json"  # written under Ray: the transport each engine got
    transport = (
        json.loads(placed.read_text())["engines"]["0"]["transport"]
        if placed.exists()
        else cfg["engine"]["weight_transport"]
    )
    return {
        "startup_s": first_step if first_step is not None else wall,
        "samples_per_s": per_step * (len(rows) - 1) / span,
        "sync_s": statistics.median(r["weight_sync_s"] for r in rows),
        "wall_s": wall,
        "steps": len(rows),
        "transport": transport,
    }


@contextlib.contextmanager
def two_node_cluster(wanted: bool) -> Iterator[str | None]:
    """The address of a running two-node Ray cluster on this host (None when not wanted)."""
    if not wanted:
        yield None
        return
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"head": 4}})
    try:
        nodes.add_node(num_cpus=4, resources={"other": 4})
        nodes.wait_for_nodes()
        yield nodes.address
    finally:
        nodes.shutdown()


def launcher_overrides(address: str | None) -> dict[str, list[str]]:
    attached = ["cluster.launcher=ray", f"cluster.address={address}"]
    return {
        "local": [],
        "ray (new)": ["cluster.launcher=ray"],
        "ray (same node)": [*attached, "cluster.engine_resources={head: 1}"],
        "ray (other node)": [*attached, "cluster.engine_resources={other: 1}"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    results: dict[str, list[dict]] = {k: [] for k in args.launchers}
    work = Path(tempfile.mkdtemp(prefix="ray-launcher-"))  # kept if a run fails: its log
    with two_node_cluster(any(x in ATTACHED for x in args.launchers)) as address:
        overrides = launcher_overrides(address)
        for repeat in range(args.repeats):
            for label in args.launchers:
                name = f"{label.replace(' (', '-').rstrip(')').replace(' ', '-')}-{repeat}"
                print(f"repeat {repeat + 1}/{args.repeats}: {label} ...", flush=True)
                results[label].append(run_once(args, name, overrides[label], work))
    shutil.rmtree(work)
    summary = {
        label: {
            key: statistics.median(r[key] for r in runs)
            for key in ("startup_s", "samples_per_s", "sync_s", "wall_s")
        }
        | {"transport": runs[0]["transport"]}
        for label, runs in results.items()
    }
    base = summary.get("local")
    print(
        f"\n{'launcher':18} {'weights':>7} {'start-up s':>11} {'samples/s':>10} {'vs local':>9} "
        f"{'sync s':>7} {'wall s':>7}"
    )
    for label, s in summary.items():
        ratio = f"{s['samples_per_s'] / base['samples_per_s']:8.2f}x" if base else f"{'-':>9}"
        print(
            f"{label:18} {s['transport']:>7} {s['startup_s']:11.1f} {s['samples_per_s']:10.2f} "
            f"{ratio} {s['sync_s']:7.3f} {s['wall_s']:7.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"steps": args.steps, "repeats": args.repeats, "median": summary, "runs": results}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {args.out}")
    write_result("ray_launcher", record, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
