"""GRPO through the Tinker API: a training loop that owns every step, as tinker-cookbook's
`recipes/rl_loop.py` does, run against `asyncgrpo tinker-serve` (or any Tinker server).

Per batch: save the LoRA weights for a sampler, sample a group of completions per prompt,
score them, centre each group's rewards (advantage = reward - group mean; no division by
the standard deviation, as in the cookbook), and take one `importance_sampling` step on
the sampler's own log-probs. The task is asyncgrpo's built-in `word_count` ("Describe cats
in exactly 4 words."), which needs no download; a held-out set scored greedily before and
after training shows whether the model learned to stop on time.

Departs from the cookbook's loop in two small ways: the group is one `sample` call with
`num_samples=G` (the server samples it as one batch), and groups whose rewards are all
equal are dropped before the step (their advantages are zero, so they would only cost time).

    ASYNCGRPO_TINKER_API_KEY=tml-local-secret asyncgrpo tinker-serve --model smollm2-135m &
    ASYNCGRPO_TINKER_API_KEY=tml-local-secret python examples/tinker_rl_loop.py \
        --base-url http://127.0.0.1:8100 --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import tinker
from tinker import types

from asyncgrpo.learning.tasks import get_reward, make_rows

TASK, REWARD = "word_count", "word_count_reward"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8100")
    parser.add_argument("--model", default="smollm2-135m", help="the server's base model")
    parser.add_argument("--steps", type=int, default=8, help="training steps (batches)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--batch-prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per completion")
    parser.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def api_key() -> str:
    """$TINKER_API_KEY (the SDK's own variable), else the server's $ASYNCGRPO_TINKER_API_KEY."""
    key = os.environ.get("TINKER_API_KEY") or os.environ.get("ASYNCGRPO_TINKER_API_KEY")
    if not key:
        raise SystemExit("set $TINKER_API_KEY (or $ASYNCGRPO_TINKER_API_KEY) to the server's key")
    return key


def render(tokenizer, row: dict) -> types.ModelInput:
    """The prompt as the chat template renders it, ending where the assistant's turn starts."""
    text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return types.ModelInput.from_ints(tokenizer.encode(text, add_special_tokens=False))


def score(tokenizer, row: dict, sequences) -> list[float]:
    """The task's reward for each sampled sequence of one prompt."""
    texts = [tokenizer.decode(seq.tokens, skip_special_tokens=True) for seq in sequences]
    columns = {"num_words": [row["num_words"]] * len(texts)}
    rewards = get_reward(REWARD)([row["prompt"]] * len(texts), texts, None, **columns)
    return [float(r or 0.0) for r in rewards]


def group_datums(prompt: list[int], sequences, rewards: list[float]) -> list[types.Datum]:
    """One datum per completion: position i predicts token i + 1; the prompt's positions
    carry advantage 0 (and a placeholder log-prob), the completion's the group-centred
    advantage and the log-probs the sampler drew it with."""
    advantages = np.asarray(rewards) - np.mean(rewards)  # (G,)
    datums = []
    for seq, advantage in zip(sequences, advantages, strict=True):
        tokens = prompt + list(seq.tokens)
        n_prompt = len(prompt) - 1  # targets that are still prompt tokens
        logprobs = [0.0] * n_prompt + list(seq.logprobs)  # (T - 1,)
        advantage_per_token = [0.0] * n_prompt + [float(advantage)] * len(seq.tokens)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
                    "logprobs": types.TensorData.from_numpy(np.array(logprobs, np.float32)),
                    "advantages": types.TensorData.from_numpy(
                        np.array(advantage_per_token, np.float32)
                    ),
                },
            )
        )
    return datums


def evaluate(sampler, tokenizer, rows: list[dict], max_tokens: int) -> float:
    """Mean reward of one greedy (temperature 0) completion per held-out prompt."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(render(tokenizer, row), 1, params) for row in rows]
    rewards = [score(tokenizer, row, f.result().sequences)[0] for row, f in zip(rows, futures)]
    return float(np.mean(rewards))


def train_step(trainer, sampler, tokenizer, rows: list[dict], args) -> tuple[float, int]:
    """Sample a group per prompt, score, centre, and take one step; (mean reward, datums)."""
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    prompts = [render(tokenizer, row) for row in rows]
    futures = [sampler.sample(p, args.group_size, params) for p in prompts]  # all in flight
    datums, rewards = [], []
    for row, prompt, future in zip(rows, prompts, futures, strict=True):
        sequences = future.result().sequences
        group = score(tokenizer, row, sequences)
        rewards.extend(group)
        if max(group) > min(group):  # an all-equal group has no signal
            datums.extend(group_datums(prompt.to_ints(), sequences, group))
    if datums:
        step = trainer.forward_backward(datums, "importance_sampling")
        optim = trainer.optim_step(types.AdamParams(learning_rate=args.lr))
        step.result(), optim.result()  # both queued before waiting on either
    return float(np.mean(rewards)), len(datums)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; returns the held-out greedy reward before and after, and the wall time."""
    args = parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # the session ends with the block (its heartbeats stop, the server marks it finished)
    with tinker.ServiceClient(base_url=args.base_url, api_key=api_key()) as service:
        return run_training(service, args)


def run_training(service, args) -> dict[str, float]:
    """The loop itself, on an open `ServiceClient`: evaluate, train `args.steps`, evaluate."""
    trainer = service.create_lora_training_client(
        base_model=args.model, rank=args.rank, seed=args.seed
    ).result()
    tokenizer = trainer.get_tokenizer()  # the server's local directory: no hub access
    rows = make_rows(TASK, 10_000, args.seed)  # every distinct prompt, shuffled
    held_out, train = rows[: args.eval_prompts], rows[args.eval_prompts :]

    start = time.monotonic()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    before = evaluate(sampler, tokenizer, held_out, args.max_tokens)
    print(f"held-out greedy reward before: {before:.3f}", flush=True)
    for step in range(args.steps):
        first = step * args.batch_prompts % len(train)
        batch = (train + train)[first : first + args.batch_prompts]
        reward, n = train_step(trainer, sampler, tokenizer, batch, args)
        sampler = trainer.save_weights_and_get_sampling_client().result()  # new weights
        elapsed = time.monotonic() - start
        print(f"step {step}: mean reward {reward:.3f}, {n} datums, {elapsed:.0f} s", flush=True)
    after = evaluate(sampler, tokenizer, held_out, args.max_tokens)
    elapsed = time.monotonic() - start
    print(f"held-out greedy reward after: {after:.3f} ({before:.3f} before), {elapsed:.0f} s")
    return {"before": before, "after": after, "seconds": elapsed}


if __name__ == "__main__":
    main()
