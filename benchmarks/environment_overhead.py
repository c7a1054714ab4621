"""What each environment adapter costs per training step, against a native rollout doing
the same work.

For each environment shape (TRL's `environment_factory`, an OpenEnv server, a verifiers
environment of the classic API, and `verifiers-v1`: the same verifiers environment ported
to verifiers 0.4, `word_budget_v1.py`) this trains its example recipe
(`recipes/trl_environment.yaml`, `openenv_guess.yaml`, `verifiers_word_budget.yaml`, the
last with the port as its environment for `verifiers-v1`) for a few steps two ways,
alternating run by run (A B, B A, ...):

- `adapter`: the recipe as written, its environment through asyncgrpo's adapter;
- `native`: the same recipe with `agent.rollout` set to the function of
  `benchmarks/environment_native.py` that plays the same episodes in process (same
  environment logic, prompts, tool schema, sampling and turn limit; see its docstring
  for the two places it cannot be identical).

Both ways read the same rows (`dataset:` with no held-out part, so no evaluation runs)
on the same model, engine and trainer settings; zero-variance groups are kept (a random
model's groups often score all 0), so every step trains the same number of groups. A
run's rate is taken from its metrics between the first and the last optimizer step
(start-up, the OpenEnv server's included, and the first step are left out): steps/s and
episodes/s. Overhead = native steps/s / adapter steps/s - 1 (the extra wall time per
step the adapter costs), medians over the repeats. Per sampled token: a run's time per
sampled token (1 / (episodes trained per second x sampled tokens per episode)) and its
median episode's (wall time / sampled tokens), and the CPU time of the benchmark's
process per sampled token (it holds the rollouts, the environment and the trainer; the
engine's process does the same work both ways), each as adapter / native - 1 of the two
runs of a repeat (neighbours in time, so a machine's other load touches both alike),
median over the repeats. On a shared machine the wall-time figures swing with the other
load; the CPU figure much less, and it is what an adapter costs a machine whose cores
are all busy.

Steps overlap generation with training (the recipes' staleness 1), so an adapter slows
steps only where generation is the bottleneck: the table shows the trainer's idle share
(waiting for a batch), and each episode's own wall time (`episode s`, median; gateway
open to close, the engine's queue included), which the adapter lengthens whatever the
bottleneck. It also shows turns per episode, the tokens of an episode's recorded
sequences (prompt and completion) and the sampled tokens per trained sequence, which
must agree between the two ways for the comparison to mean anything.

The default model (`tiny`) is a random 2-layer model with SmolLM2's tokenizer and chat
template: the prompts have their real length, but it never writes a tool call, so its
episodes end at the first reply (TRL, OpenEnv) or take the environment's two turns
(verifiers), and per-tool-call costs are not exercised. `--model smollm2-135m` trains
the examples' own model, which calls the tools (slower: minutes per run on CPU).

    .venv/bin/python benchmarks/environment_overhead.py
    .venv-verifiers/bin/python benchmarks/environment_overhead.py --shapes verifiers-v1 --repeats 10

(from the repository root; the first: 18 runs of 6 steps, 3 to 6 minutes on 2 shared cores
with the tiny model. verifiers 0.3 and 0.4 cannot share an environment: the second, in the
one `make verifiers-venv` builds, measures `verifiers-v1`, the only shape it runs there.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, Path(__file__).resolve().parent):  # `examples.*`, `environment_native`
    if str(path) not in sys.path:
        sys.path.append(str(path))

import environment_native  # noqa: E402
from result_files import SCRATCH, write_result  # noqa: E402

from asyncgrpo.base.config import build_config  # noqa: E402
from asyncgrpo.learning.rollout import episodes as episodes_mod  # noqa: E402
from asyncgrpo.run.loop import train  # noqa: E402

SHAPES = {
    "trl": ("recipes/trl_environment.yaml", "environment_native:trl_rollout"),
    "openenv": ("recipes/openenv_guess.yaml", "environment_native:openenv_rollout"),
    "verifiers": ("recipes/verifiers_word_budget.yaml", "environment_native:verifiers_rollout"),
    "verifiers-v1": (
        "recipes/verifiers_word_budget.yaml",
        "environment_native:verifiers_v1_rollout",
    ),
}
# the word-budget recipe's environment as verifiers 0.4 loads it: its port (`word_budget_v1`)
V1_ENVIRONMENT = {"id": "word-budget-v1", "args": {"num_train": 400}}
WAYS = ("adapter", "native")
SOURCES = ("environment", "openenv", "verifiers")  # the agent keys of the adapters
EPISODE_METRICS = ("turns_per_episode", "tool_calls_per_episode")  # means per episode
STEP_METRICS = ("completion_len_mean", "trainer_idle_ratio")  # means per step
PER_TOKEN = ("sampled_per_episode", "ms_per_sampled_token", "episode_ms_per_sampled_token")
CPU = ("cpu_ms_per_sampled_token",)  # this process's: rollouts, environment, trainer
MEDIANS = (
    *("steps_per_s", "episodes_per_s", "episode_s", "episode_tokens"),
    *PER_TOKEN,
    *CPU,
    *EPISODE_METRICS,
    *STEP_METRICS,
)


def verifiers_04() -> bool:
    """Whether the installed verifiers is 0.4 (`.venv-verifiers`, without openenv), which
    runs its own API only: the verifiers-v1 shape there, the others where 0.3 is (`.venv`)."""
    from asyncgrpo.learning.environments.verifiers import new_api

    try:
        return new_api(importlib.metadata.version("verifiers"))
    except importlib.metadata.PackageNotFoundError:
        return False


def check_shapes(parser: argparse.ArgumentParser, shapes: list[str]) -> None:
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    if verifiers_04() and set(shapes) - {"verifiers-v1"}:
        parser.error("verifiers 0.4 is installed: only --shapes verifiers-v1 runs here")
    if not verifiers_04() and "verifiers-v1" in shapes:
        parser.error("--shapes verifiers-v1 needs verifiers 0.4: run it with .venv-verifiers")


def shape_recipe(shape: str) -> dict:
    """The example recipe of `shape` (for verifiers-v1, its environment the 0.4 port)."""
    recipe = yaml.safe_load((ROOT / SHAPES[shape][0]).read_text())
    if shape == "verifiers-v1":
        recipe["agent"]["verifiers"] = copy.deepcopy(V1_ENVIRONMENT)
    return recipe


def shape_rows(shape: str, recipe: dict, work: Path) -> str:
    """The rows file both ways read: the recipe's own, or (verifiers, whose rows come from
    the environment) the environment's dataset written out."""
    section = recipe["agent"].get("verifiers") or {}
    args = dict(section.get("args") or {})
    if shape == "verifiers-v1":
        import word_budget_v1

        rows = word_budget_v1.rows(args["num_train"], args.get("seed", 0))
    elif shape == "verifiers":
        from asyncgrpo.learning.environments import verifiers as classic

        env = classic.load_environment(classic.classic_api(), section["id"], args)
        rows = classic.rows_of(env.get_dataset())
    else:
        return str(ROOT / recipe["dataset"]["path"])
    path = work / f"{shape}_rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def run_config(shape: str, way: str, recipe: dict, rows: str, run_dir: Path, args) -> dict:
    """The recipe shrunk to the benchmark's size; for `native`, the adapter swapped for the
    native rollout (and TRL's reward functions dropped: the rollout computes the reward)."""
    cfg = copy.deepcopy(recipe)
    cfg.update(
        name=f"{shape}-{way}",
        output_dir=str(run_dir),
        max_steps=args.steps,
        max_time_s=args.max_time_s,
        eval_steps=10**6,
        checkpoint_steps=10**6,
        dataset={"path": rows, "eval_size": 0},
    )
    cfg["model"]["name_or_path"] = args.model_dir
    cfg["engine"]["num_threads"] = args.engine_threads
    cfg["trainer"]["num_threads"] = args.trainer_threads
    cfg["rollout"].update(num_generations=args.group, filter_zero_variance=False)
    if args.max_tokens is not None:
        cfg["rollout"]["max_tokens"] = args.max_tokens
    cfg["coordinator"]["batch_groups"] = args.groups
    if way == "native":
        cfg["agent"] = {k: v for k, v in cfg["agent"].items() if k not in SOURCES}
        cfg["agent"]["rollout"] = SHAPES[shape][1]
        if shape == "trl":
            cfg.pop("rewards", None)
    return cfg


@contextlib.contextmanager
def watched_episodes(into: list[tuple[float, int, int, float]]):
    """Collect each finished episode's wall time (gateway open to close), the tokens of
    its recorded sequences (prompt and completion: what the engine and the trainer see),
    its sampled tokens and this process's CPU seconds when it ended, as the integration
    tests watch episodes: by wrapping the group builder's `run_episode`."""
    run_episode = episodes_mod.run_episode

    async def timed(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        if outcome.stop_reason.value in ("ok", "length", "max_turns"):
            tokens = sum(len(sample.input_ids) for sample in outcome.samples)
            sampled = sum(sum(sample.loss_mask) for sample in outcome.samples)
            into.append((outcome.info["seconds"], tokens, sampled, time.process_time()))
        return outcome

    episodes_mod.run_episode = timed
    try:
        yield
    finally:
        episodes_mod.run_episode = run_episode


def timed_run(shape: str, way: str, cfg_data: dict, openenv_prompt) -> dict:
    """Train once; the rates between the first and the last optimizer step."""
    cfg = build_config(cfg_data)
    environment_native.configure(cfg, openenv_prompt)
    episodes: list[tuple[float, int, int, float]] = []
    start = time.monotonic()
    with watched_episodes(episodes):
        run_dir = train(cfg)
    wall = time.monotonic() - start
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = sorted((x for x in lines if x.get("kind") == "train"), key=lambda x: x["step"])
    if len(steps) < 2:
        raise SystemExit(f"{shape} {way}: {len(steps)} optimizer step(s) logged; need 2 or more")
    span = steps[-1]["time_s"] - steps[0]["time_s"]
    later = steps[1:]  # the steps inside the span
    row = {
        "shape": shape,
        "way": way,
        "steps": len(steps),
        "first_step_s": steps[0]["time_s"],
        "span_s": span,
        "wall_s": wall,
        "steps_per_s": len(later) / span,
        "episodes_per_s": sum(x.get("episodes", 0) for x in later) / span,
        "stop_reasons": _summed(x.get("stop_reasons", {}) for x in steps),
    }
    trained_per_step = cfg.coordinator.batch_groups * cfg.rollout.num_generations
    row |= episode_figures(episodes, row["steps_per_s"] * trained_per_step)
    for key in EPISODE_METRICS + STEP_METRICS:  # over the whole run
        per_episode = key in EPISODE_METRICS
        weighted = [(x[key], x.get("episodes", 0) if per_episode else 1) for x in steps if key in x]
        total = sum(n for _, n in weighted)
        row[key] = sum(v * n for v, n in weighted) / total if total else None
    print(
        f"  {shape:<13}{way:<8}{row['steps_per_s']:>8.3f} steps/s {row['episodes_per_s']:>8.2f}"
        f" episodes/s  (first step at {row['first_step_s']:.1f} s, wall {wall:.1f} s)",
        flush=True,
    )
    return row


def episode_figures(episodes: list[tuple[float, int, int, float]], trained_per_s: float) -> dict:
    """What the watched episodes say: the median episode's wall time, the mean tokens of
    an episode's sequences and of its sampled tokens, the time per sampled token, of the
    run (1 / (episodes trained per second x sampled tokens per episode); every step trains
    the same number of episodes) and of the median episode, and this process's CPU time
    per sampled token from the first episode's end to the last's (start-up left out)."""
    timed = [e for e in episodes if e[2]]  # an episode with a sampled token
    if len(timed) < 2:
        return dict.fromkeys(("episode_s", "episode_tokens", *PER_TOKEN, *CPU))
    sampled = statistics.fmean(e[2] for e in episodes)
    later = sum(e[2] for e in episodes[1:])  # what was sampled after the first episode ended
    return {
        "cpu_ms_per_sampled_token": 1000 * (episodes[-1][3] - episodes[0][3]) / later,
        "episode_s": statistics.median(e[0] for e in episodes),
        "episode_tokens": statistics.fmean(e[1] for e in episodes),
        "sampled_per_episode": sampled,
        "ms_per_sampled_token": 1000 / (trained_per_s * sampled),
        "episode_ms_per_sampled_token": statistics.median(1000 * e[0] / e[2] for e in timed),
    }


def _summed(counters) -> dict:
    out: dict = {}
    for counter in counters:
        for key, n in counter.items():
            out[key] = out.get(key, 0) + n
    return out


def tiny_model(work: Path) -> str:
    from asyncgrpo.testing import save_tiny_vllm_model_dir

    return str(save_tiny_vllm_model_dir(work / "tiny-model"))


def measure(args, work: Path) -> list[dict]:
    runs = []
    for shape in args.shapes:
        recipe = shape_recipe(shape)
        rows = shape_rows(shape, recipe, work)
        openenv_prompt = (recipe["agent"].get("openenv") or {}).get("prompt")
        for repeat in range(args.repeats):
            for way in WAYS if repeat % 2 == 0 else WAYS[::-1]:
                run_dir = work / "runs" / f"{shape}-{way}-{repeat}"
                cfg = run_config(shape, way, recipe, rows, run_dir, args)
                runs.append(timed_run(shape, way, cfg, openenv_prompt) | {"repeat": repeat})
    return runs


def summarise(runs: list[dict]) -> dict:
    """Per shape: each way's medians, and the adapter's overhead: per step (the ratio of
    the medians) and per sampled token (the median of each repeat's adapter / native
    ratio, the two runs of a repeat being neighbours in time)."""
    summary = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        ways = {}
        for way in WAYS:
            mine = [r for r in runs if r["shape"] == shape and r["way"] == way]
            ways[way] = {
                key: statistics.median(r[key] for r in mine)
                for key in MEDIANS
                if all(r.get(key) is not None for r in mine)
            }
        adapter, native = ways["adapter"], ways["native"]
        ways["overhead"] = native["steps_per_s"] / adapter["steps_per_s"] - 1
        ways["adapter_over_native_steps_per_s"] = adapter["steps_per_s"] / native["steps_per_s"]
        if "episode_s" in adapter and "episode_s" in native:
            ways["adapter_over_native_episode_s"] = adapter["episode_s"] / native["episode_s"]
        for key, name in PAIRED.items():
            ratios = paired_ratios([r for r in runs if r["shape"] == shape], key)
            if ratios:
                ways[name] = statistics.median(ratios) - 1
                ways[f"{name}_per_repeat"] = [x - 1 for x in ratios]
        summary[shape] = ways
    return summary


# per sampled token, adapter / native - 1: of the run's throughput, of an episode's latency,
# of this process's CPU
PAIRED = {
    "ms_per_sampled_token": "overhead_per_sampled_token",
    "episode_ms_per_sampled_token": "episode_overhead_per_sampled_token",
    "cpu_ms_per_sampled_token": "cpu_overhead_per_sampled_token",
}


def paired_ratios(runs: list[dict], key: str) -> list[float]:
    """adapter / native of `key`, one ratio per repeat that has both."""
    by_repeat: dict[int, dict[str, float]] = {}
    for r in runs:
        if r.get(key) is not None:
            by_repeat.setdefault(r["repeat"], {})[r["way"]] = r[key]
    return [w["adapter"] / w["native"] for w in by_repeat.values() if len(w) == len(WAYS)]


COLUMNS = (  # (heading, key, format)
    ("steps/s", "steps_per_s", "{:.3f}"),
    ("episodes/s", "episodes_per_s", "{:.2f}"),
    ("episode s", "episode_s", "{:.3f}"),
    ("turns", "turns_per_episode", "{:.2f}"),
    ("calls", "tool_calls_per_episode", "{:.2f}"),
    ("seq tokens", "episode_tokens", "{:.1f}"),
    ("sampled", "completion_len_mean", "{:.1f}"),
    ("ms/token", "ms_per_sampled_token", "{:.2f}"),
    ("ep ms/token", "episode_ms_per_sampled_token", "{:.2f}"),
    ("cpu ms/token", "cpu_ms_per_sampled_token", "{:.2f}"),
    ("trainer idle", "trainer_idle_ratio", "{:.0%}"),
)


def report(summary: dict) -> None:
    """One line per shape and way; the adapter's line ends with its ratios to native."""
    print(f"{'shape':<13}{'way':<8}" + "".join(f"{h:>13}" for h, _, _ in COLUMNS), end="")
    print(f"{'steps/s a/n':>13}{'episode s a/n':>15}")
    for shape, ways in summary.items():
        for way in WAYS:
            m = ways[way]
            cells = "".join(f"{fmt.format(m[k]) if k in m else '-':>13}" for _, k, fmt in COLUMNS)
            ratios = ""
            if way == "adapter":
                ratios = f"{ways['adapter_over_native_steps_per_s']:>13.3f}"
                ratios += f"{ways.get('adapter_over_native_episode_s', float('nan')):>15.3f}"
            print(f"{shape:<13}{way:<8}{cells}{ratios}")
    print("overhead (native steps/s / adapter steps/s - 1): ", end="")
    print(", ".join(f"{shape} {ways['overhead']:+.1%}" for shape, ways in summary.items()))
    print("overhead per sampled token (median of paired adapter / native - 1): ")
    for shape, ways in summary.items():
        run, episode, cpu = (ways.get(name) for name in PAIRED.values())
        print(f"  {shape}: run {_percent(run)}, episode {_percent(episode)}, CPU {_percent(cpu)}")


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default=None, help="default: verifiers-v1 under verifiers 0.4, else the others"
    )
    parser.add_argument("--model", default="tiny", help="`tiny` (random), a name or a directory")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per way and shape")
    parser.add_argument("--group", type=int, default=4, help="rollout.num_generations")
    parser.add_argument("--groups", type=int, default=2, help="coordinator.batch_groups")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--max-time-s", type=float, default=1200.0, help="per run")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=SCRATCH / "environment_overhead.json")
    parser.add_argument("--note", help="kept with the figures: how to read them (the load, ...)")
    args = parser.parse_args(argv)
    default = "verifiers-v1" if verifiers_04() else "trl,openenv,verifiers"
    args.shapes = [s for s in (args.shapes or default).split(",") if s]
    check_shapes(parser, args.shapes)
    with tempfile.TemporaryDirectory(prefix="environment-overhead-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        args.model_dir = tiny_model(work) if args.model == "tiny" else args.model
        runs = measure(args, work)
    summary = summarise(runs)
    report(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "model_dir"}
    settings |= {"out": str(args.out), "work": args.work and str(args.work)}
    record = dict(settings=settings, runs=runs, summary=summary)
    if args.note:
        record["note"] = args.note
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    write_result("environment_overhead", record, argv)


if __name__ == "__main__":
    main()
