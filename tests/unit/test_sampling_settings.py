"""One sampling-settings object from the recipe to the request: `RolloutConfig.sampling`
builds it, `request_fields` is the only place that turns it into request fields."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from asyncgrpo.base.config import SamplingSettings, build_config
from asyncgrpo.inference.client.engine_client import Completion, Continuation
from asyncgrpo.run.roles import group_builder as _builder


def test_the_recipe_builds_the_settings_once_by_name():
    cfg = build_config(
        {"rollout": {"num_generations": 4, "temperature": 0.7, "top_p": 0.9}},
        ["max_completion_length=32", "max_prompt_length=100", "seed=5"],  # TRL names too
    )
    assert cfg.rollout.sampling(cfg.seed) == SamplingSettings(
        n=4, max_tokens=32, temperature=0.7, top_p=0.9, seed=5, max_prompt_length=100
    )


def test_settings_are_frozen_and_named():
    s = SamplingSettings(n=2, max_tokens=8)
    with pytest.raises(TypeError):
        SamplingSettings(2, 8)  # no positional construction
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n = 3


def test_request_fields_seed_each_group_from_the_runs_seed():
    s = SamplingSettings(n=4, max_tokens=16, temperature=0.7, top_p=0.9, seed=3)
    assert s.request_fields() == {"n": 4, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9}
    assert s.request_fields(11)["seed"] == 3 * 7919 + 11
    assert s.request_fields(11) == s.request_fields(11)  # the same group, the same seed
    assert s.request_fields(11)["seed"] != s.request_fields(12)["seed"]
    unseeded = dataclasses.replace(s, seed=None)
    assert "seed" not in unseeded.request_fields(11)
    huge = dataclasses.replace(s, seed=2**40)
    assert 0 <= huge.request_fields(1)["seed"] < 2**31


def test_a_continuation_and_a_greedy_evaluation_keep_the_rest():
    s = SamplingSettings(n=4, max_tokens=16, temperature=0.7, top_p=0.9, seed=3)
    assert s.continuing(5).request_fields() == {
        "n": 1,
        "max_tokens": 11,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    assert s.greedy().request_fields(7) == {
        "n": 1,
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
    }


class Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [100 + ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def complete(self, prompt_ids, **fields) -> Completion:
        self.calls.append(fields)
        samples = [
            Continuation([7, 8 + i], [-0.1, -0.2], [0, 0], "stop") for i in range(fields["n"])
        ]
        return Completion(samples, list(prompt_ids))


class Rewards:
    names = ["index"]

    async def score_group(self, row, texts, ids) -> list[list[float]]:
        return [[float(i) for i in range(len(texts))]]


def test_the_builder_sends_the_recipes_settings_as_the_request_fields():
    cfg = build_config({"seed": 9, "rollout": {"num_generations": 3, "temperature": 0.8}})
    client = RecordingClient()
    builder = _builder(cfg, client, Tokenizer(), Rewards(), None)
    asyncio.run(builder.build(4, {"prompt": "ab"}))
    assert client.calls == [cfg.rollout.sampling(cfg.seed).request_fields(4)]
    assert client.calls[0]["temperature"] == 0.8 and client.calls[0]["seed"] == 9 * 7919 + 4
