"""A tinker-cookbook RL environment that needs no download, and `rl.train` run on it.

Run by `test_tinker_cookbook.py` with the Python of a separate environment that has
`tinker-cookbook` installed (`make cookbook-venv`): the cookbook pins its own versions of
transformers and protobuf, so it does not go into asyncgrpo's environment. This file
imports only the cookbook (and the SDK it brings), never asyncgrpo.

The task: "What is A + B?" with small numbers; the reward is the cookbook's `ProblemEnv`
reward (1 for the sum in the answer, minus 0.1 for a malformed reply). The prompt goes
through the `role_colon` renderer, which works with any tokenizer; the tokenizer comes from
the local model directory, which is also the model name the server accepts, so nothing is
looked up on the hub.

    python tinker_cookbook_env.py --base-url URL --model DIR --log-path DIR [--steps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Sequence
from functools import partial

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

RENDERER = "role_colon"


class AdditionEnv(ProblemEnv):
    """One question "What is A + B?"; correct when the reply contains A + B."""

    def __init__(self, renderer: renderers.Renderer, a: int, b: int):
        super().__init__(renderer, require_stop_sequence_for_format=False)
        self.a, self.b = a, b

    def get_question(self) -> str:
        return f"What is {self.a} + {self.b}? Answer with the number only."

    def check_answer(self, sample_str: str) -> bool:
        return str(self.a + self.b) in sample_str

    def check_format(self, sample_str: str) -> bool:
        return sample_str.strip() != ""

    def get_reference_answer(self) -> str:
        return str(self.a + self.b)


class AdditionDataset(RLDataset):
    """`batches` batches of `groups` questions, each asked `group_size` times."""

    def __init__(self, renderer, batches: int, groups: int, group_size: int, seed: int):
        rng = random.Random(seed)
        self.questions = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(batches * groups)]
        self.renderer, self.groups, self.group_size = renderer, groups, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        chosen = self.questions[index * self.groups : (index + 1) * self.groups]
        return [
            ProblemGroupBuilder(
                partial(AdditionEnv, self.renderer, a, b), self.group_size, "addition"
            )
            for a, b in chosen
        ]

    def __len__(self) -> int:
        return len(self.questions) // self.groups


@chz.chz
class AdditionDatasetBuilder(RLDatasetBuilder):
    """Builds the training set; no test set."""

    model_dir: str
    batches: int = 2
    groups: int = 2
    group_size: int = 4
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_dir))
        return AdditionDataset(
            renderer, self.batches, self.groups, self.group_size, self.seed
        ), None


def config(base_url: str, model: str, log_path: str, steps: int, **extra) -> train.Config:
    """`rl.train`'s config for `steps` batches on the addition task against `base_url`."""
    return train.Config(
        learning_rate=1e-4,
        dataset_builder=AdditionDatasetBuilder(model_dir=model, batches=steps),
        model_name=model,
        recipe_name="asyncgrpo_addition",
        max_tokens=8,
        log_path=log_path,
        renderer_name=RENDERER,
        lora_rank=8,
        eval_every=0,
        save_every=0,
        base_url=base_url,
        max_steps=steps,
        **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the local model directory served")
    parser.add_argument("--log-path", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--async-off-policy", type=int, default=0, help="max_steps_off_policy")
    args = parser.parse_args()
    extra = {}
    if args.async_off_policy:
        extra["async_config"] = train.AsyncConfig(
            max_steps_off_policy=args.async_off_policy, groups_per_batch=2
        )
    asyncio.run(train.main(config(args.base_url, args.model, args.log_path, args.steps, **extra)))


if __name__ == "__main__":
    main()
