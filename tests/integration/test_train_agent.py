"""Training an agent through the pipeline: a two-turn OpenAI-client rollout on a tiny model.

The real pipeline (engine child process, episode gateway, orchestrator with
episode groups, buffer, trainer) runs 3 synchronous steps. The agent asks, gets
a fake tool result, asks again. Checked: every trained sequence is exactly an
episode sample the gateway recorded — its prompt is the first call's prompt
ids, its loss-carrying tokens are exactly the two replies' sampled ids (as the
engine returned them), the tool message between them carries no loss — and
each step trained on tokens of the weights of that step.
"""

from __future__ import annotations

import json

from test_train import Recorder, base_config, flat, read_jsonl

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.learning.rollout import episodes as episodes_mod
from asyncgrpo.run.loop import train
from asyncgrpo.testing import tiny_prompt_rows

SAMPLED: dict[str, list] = {}  # episode api key -> [(prompt ids, sampled ids), ...] per call


async def two_turn_rollout(task: dict, llm) -> float:
    """Ask, answer with a fake tool result, ask again; reward from the reply text."""
    messages = list(task["prompt"])
    calls = SAMPLED.setdefault(llm.api_key, [])
    texts = []
    async with llm.client() as client:
        for turn in range(2):
            response = await client.chat.completions.create(
                model=llm.model,
                messages=messages,
                max_tokens=5,
                extra_body={"return_token_ids": True},
            )
            choice = response.choices[0]
            calls.append((response.prompt_token_ids, choice.token_ids))
            texts.append(choice.message.content or "")
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            if turn == 0:
                messages.append({"role": "tool", "content": "result: 42"})
    return float(sum(len(t) for t in texts) % 4)


def test_two_turn_agent_trains_on_the_exact_episode_tokens(tmp_path, tiny_model_dir, monkeypatch):
    recorder = Recorder(monkeypatch)
    outcomes = []

    async def recording_run_episode(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    run_episode = episodes_mod.run_episode
    monkeypatch.setattr(episodes_mod, "run_episode", recording_run_episode)
    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "agent",
        max_steps=3,
        **{
            "engine.max_model_len": 256,
            "rollout.num_generations": 3,
            "agent.max_turns": 2,
            "agent.episode_timeout_s": 60,
        },
    )
    args = AsyncGRPOConfig(**flat(cfg))
    run_dir = train(
        args,
        rollout_func=two_turn_rollout,
        train_dataset=tiny_prompt_rows(30),
        eval_dataset=tiny_prompt_rows(2),
    )

    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert len(recorder.batches) == 3, accounting
    recorded = {tuple(s.input_ids): s for o in outcomes for s in o.samples}
    calls_by_sequence = {}
    for calls in SAMPLED.values():
        if not calls:  # an episode stopped at shutdown before its first reply: never trained
            continue
        sampled = [t for _, ids in calls for t in ids]
        calls_by_sequence[(tuple(calls[0][0]), tuple(sampled))] = calls
    for step, groups in enumerate(recorder.batches):
        for group in groups:
            assert len(group.rollouts) >= 2
            for r in group.rollouts:
                sequence = tuple(r.prompt_ids + r.completion_ids)
                sample = recorded[sequence]  # the gateway's own sample, token for token
                mask = r.completion_mask
                assert [0] * len(r.prompt_ids) + mask == sample.loss_mask
                sampled = tuple(t for t, m in zip(r.completion_ids, mask, strict=True) if m)
                # the loss covers exactly what the engine sampled in the two calls
                calls = calls_by_sequence[(tuple(r.prompt_ids), sampled)]
                assert len(calls) == 2
                assert 0 in mask[len(calls[0][1]) :], "the tool turn must sit between the replies"
                assert list(r.prompt_ids + r.completion_ids[: len(calls[0][1])]) == list(
                    calls[0][0]
                ) + list(calls[0][1])
                inserted = [i for i, m in enumerate(mask) if not m]
                assert all(r.versions[i] == -1 and r.logprobs[i] == 0.0 for i in inserted)
                trained_versions = {v for v, m in zip(r.versions, mask, strict=True) if m}
                assert trained_versions == {step}, (step, r.versions, mask)
    lines = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["version"] for x in train_lines] == [1, 2, 3]
    assert all(x["turns_per_episode"] == 2 for x in train_lines if x["episodes"])
    assert all(x["branches_per_episode"] == 1 for x in train_lines if x["episodes"])
    stops = [x["stop_reasons"] for x in train_lines]
    assert sum(x.get("ok", 0) for x in stops) >= 3 * 2 * 3, stops
    evals = [x for x in lines if x["kind"] == "eval"]
    assert evals and all(x["eval_count"] == 2 for x in evals), evals
    assert accounting["consumed"] == 6, accounting
