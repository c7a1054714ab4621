"""Base rate of the calculator agent: how often untrained SmolLM2-135M calls the tool and is right.

Starts an embedded engine, runs `--episodes-per-task` episodes of
`examples/calculator_agent.py` on `--tasks` held-out problems through the
episode gateway (exactly as training does) and prints the fraction of episodes
with a tool call that ran, with the right tool result, with a correct final
answer, the mean reward, and the fraction of groups whose rewards differ.

    .venv/bin/python examples/calculator_base_rate.py --tasks 16 --episodes-per-task 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncgrpo.base.models import resolve_model  # noqa: E402
from asyncgrpo.inference.client import EngineClient  # noqa: E402
from asyncgrpo.inference.engine.process import EngineProcess  # noqa: E402
from asyncgrpo.learning.agents.runner import run_episode  # noqa: E402
from asyncgrpo.learning.tasks.calculator import calculator_rows  # noqa: E402
from examples.calculator_agent import MAX_TURNS, rollout  # noqa: E402


async def measure(base_url: str, token: str, rows: list[dict], per_task: int) -> None:
    client = EngineClient(base_url, admin_token=token)
    busy_before = (await client.server_info()).get("stats", {}).get("busy_seconds", 0.0)
    start = time.monotonic()
    groups = await asyncio.gather(
        *[
            asyncio.gather(
                *[run_episode(client, rollout, row, max_turns=MAX_TURNS) for _ in range(per_task)]
            )
            for row in rows
        ]
    )
    wall = time.monotonic() - start
    busy = (await client.server_info()).get("stats", {}).get("busy_seconds", 0.0) - busy_before
    outcomes = [o for g in groups for o in g]
    info = [o.info for o in outcomes]

    def frac(key: str) -> float:
        return sum(bool(i.get(key)) for i in info) / len(info)

    rewards = [o.reward for o in outcomes if o.reward is not None]
    varied = sum(len({o.reward for o in g}) > 1 for g in groups) / len(groups)
    reasons: dict[str, int] = {}
    for o in outcomes:
        reasons[o.stop_reason.value] = reasons.get(o.stop_reason.value, 0) + 1
    print(f"episodes {len(outcomes)} in {wall:.0f}s (engine busy {busy:.0f}s); {reasons}")
    seconds = sorted(o.info["seconds"] for o in outcomes)
    print(f"episode seconds: median {seconds[len(seconds) // 2]:.1f}, max {seconds[-1]:.1f}")
    print(
        f"tool call ran {frac('tool_ran'):.3f}  right tool result {frac('right_tool_result'):.3f}"
        f"  answered {frac('answered'):.3f}  correct {frac('correct'):.3f}"
    )
    print(
        f"reward mean {statistics.mean(rewards):.3f}  groups with variance {varied:.2f}  "
        f"turns/episode {statistics.mean(o.metrics.turns for o in outcomes):.2f}  "
        f"malformed calls {sum(o.metrics.malformed_tool_calls for o in outcomes)}"
    )
    for o in outcomes[:: max(1, len(outcomes) // 12)]:
        print("---", o.reward, o.metrics.tool_calls, repr(o.info.get("reply")))
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--episodes-per-task", type=int, default=8)
    parser.add_argument("--kind", default="multiply")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rows = calculator_rows(args.tasks, args.seed, args.kind)
    engine = EngineProcess(
        str(resolve_model(args.model)), num_threads=1, max_num_seqs=64, max_model_len=1024
    )
    with engine:
        engine.wait_ready(600)
        asyncio.run(measure(engine.base_url, engine.admin_token, rows, args.episodes_per_task))


if __name__ == "__main__":
    main()
