"""Base rates of a task: how often the untrained model already earns reward.

GRPO learns only from groups whose rewards differ, so a demo task must be
neither solved (reward ≈1) nor hopeless (≈0) for the starting model, and its
completions must be short enough for a CPU trainer. For each task this samples
`num_generations` completions per held-out prompt at the training temperature
(the embedded engine, in this process, with the training dtype) and a greedy
one (what the run's evaluation measures), and reports:

- mean reward per function and combined (their sum), sampled and greedy;
- the fraction of groups with nonzero reward variance (the learnable signal);
- the mean completion length in tokens and the fraction cut at max_tokens.

    .venv/bin/python benchmarks/base_rate.py --tasks arithmetic word_count repeat_word

The prompts are held out as `load_prompts` holds them out for a recipe
(`size: 1000`, `eval_size: --prompts`); with `--prompts 16` and the recipe's
seed they are exactly the prompts the run evaluates on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

from result_files import write_result  # benchmarks/ is on sys.path

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.types import SamplingParams
from asyncgrpo.learning.rollout.data import load_prompts, render_prompt
from asyncgrpo.learning.rollout.rewards import RewardRunner

# the rewards and max_tokens of each task's recipe (recipes/*.yaml)
DEFAULT_REWARDS = {
    "word_count": ["word_count_reward"],
    "arithmetic": ["short_arithmetic_reward"],
    "repeat_word": ["repeat_word_reward"],
}
DEFAULT_MAX_TOKENS = {"word_count": 24, "arithmetic": 16, "repeat_word": 16}


@dataclass
class Sampled:
    ids: list[int]
    finish: str


async def sample(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> list[Sampled]:
    out = [Sampled([], "length") for _ in range(params.n)]
    async for delta in engine.generate(prompt_ids, params):
        out[delta.index].ids += delta.token_ids
        if delta.finish_reason:
            out[delta.index].finish = delta.finish_reason
    return out


async def measure_task(engine, tokenizer, task: str, args) -> dict:
    spec = {"builtin": task, "size": 1000, "eval_size": args.prompts}
    _, rows = load_prompts(spec, args.seed)
    runner = RewardRunner(args.rewards or DEFAULT_REWARDS.get(task, []))
    n = args.num_generations
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS.get(task, 24)

    async def one(i: int, row: dict):
        ids = render_prompt(tokenizer, row["prompt"])
        hot = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, n=n)
        hot.seed = args.seed * 100_003 + i
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=1)
        samples, (best,) = await asyncio.gather(
            sample(engine, ids, hot), sample(engine, ids, greedy)
        )
        texts = [tokenizer.decode(s.ids, skip_special_tokens=True) for s in samples]
        scored = await runner.score_group(row, texts, [s.ids for s in samples])
        best_text = tokenizer.decode(best.ids, skip_special_tokens=True)
        best_scored = await runner.score_group(row, [best_text], [best.ids])
        return len(ids), samples, texts, scored, best_text, best_scored

    start = time.monotonic()
    results = await asyncio.gather(*[one(i, r) for i, r in enumerate(rows)])
    elapsed = time.monotonic() - start
    runner.close()

    def total(per_fn: list[list], k: int) -> float:
        return sum(s[k] or 0.0 for s in per_fn)

    combined, greedy, varied, lengths, cut = [], [], 0, [], 0
    per_fn = {name: [] for name in runner.names}
    greedy_fn = {name: [] for name in runner.names}
    for _, samples, _, scored, _, best_scored in results:
        group = [total(scored, k) for k in range(n)]
        combined += group
        varied += len(set(group)) > 1
        greedy.append(total(best_scored, 0))
        for name, s, g in zip(runner.names, scored, best_scored, strict=True):
            per_fn[name] += [x or 0.0 for x in s]
            greedy_fn[name].append(g[0] or 0.0)
        lengths += [len(s.ids) for s in samples]
        cut += sum(s.finish == "length" for s in samples)
    examples = [(t[0], results[i][4]) for i, t in enumerate(r[2] for r in results[:4])]
    return {
        "task": task,
        "rewards": runner.names,
        "prompts": len(rows),
        "max_tokens": max_tokens,
        "prompt_tokens": statistics.mean(r[0] for r in results),
        "sampled_reward": statistics.mean(combined),
        "sampled_per_function": {k: statistics.mean(v) for k, v in per_fn.items()},
        "greedy_reward": statistics.mean(greedy),
        "greedy_per_function": {k: statistics.mean(v) for k, v in greedy_fn.items()},
        "groups_with_variance": varied / len(rows),
        "completion_tokens": statistics.mean(lengths),
        "cut_at_max_tokens": cut / len(lengths),
        "seconds": round(elapsed, 1),
        "examples (sampled, greedy)": examples,
    }


def resolve(name: str) -> str:
    try:
        from asyncgrpo.base.models import resolve_model
    except ImportError:
        return name
    return str(resolve_model(name))


async def main_async(args) -> list[dict]:
    from transformers import AutoTokenizer

    model_dir = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(
        EmbeddedEngineConfig(
            model=model_dir,
            dtype=args.dtype,
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            max_model_len=512,
        )
    )
    engine.start()
    try:
        return [await measure_task(engine, tokenizer, t, args) for t in args.tasks]
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_REWARDS))
    parser.add_argument("--rewards", nargs="+", default=None, help="override the task's rewards")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts per task")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    print(
        f"\n{'task':<12} {'sampled':>8} {'greedy':>7} {'var groups':>10} "
        f"{'compl tok':>9} {'max tok':>7} {'cut':>5} {'prompt tok':>10}"
    )
    for r in results:
        print(
            f"{r['task']:<12} {r['sampled_reward']:>8.3f} {r['greedy_reward']:>7.3f} "
            f"{r['groups_with_variance']:>10.0%} {r['completion_tokens']:>9.1f} {r['max_tokens']:>7} "
            f"{r['cut_at_max_tokens']:>5.0%} {r['prompt_tokens']:>10.1f}"
        )
    for r in results:
        print(f"\n{r['task']}: {json.dumps(r, indent=1)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    write_result("base_rate", results, argv)


if __name__ == "__main__":
    main()
