"""The Python API, in TRL's spirit: a flat config and a trainer with `.train()`.

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    args = AsyncGRPOConfig(max_steps=50, num_generations=8, max_staleness=2, learning_rate=1e-5)
    AsyncGRPOTrainer(model="smollm2-135m", reward_funcs=[my_reward],
                     train_dataset=ds, eval_dataset=held_out, args=args).train()

`AsyncGRPOConfig` takes every field of the typed `RunConfig` by its own name
when it is a top-level field (`name`, `seed`, `max_steps`) or unique across sections (`learning_rate`, `max_staleness`,
`num_generations`, ...) or by its dotted path (`"engine.num_threads"`), and
validates exactly like a YAML recipe, with the same did-you-mean errors.
"""

from __future__ import annotations

import difflib
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from asyncgrpo.config import ConfigError, RunConfig, build_config


def _flat_fields() -> dict[str, str]:
    """Unique leaf field name -> dotted path, over all sections."""
    paths: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
            else:
                paths.append(f"{prefix}{name}")

    walk(RunConfig, "")
    counts = Counter(p.rsplit(".", 1)[-1] for p in paths)
    flat = {p.rsplit(".", 1)[-1]: p for p in paths if counts[p.rsplit(".", 1)[-1]] == 1}
    # top-level fields keep their own name even when a section has a field of that name
    flat.update({p: p for p in paths if "." not in p})
    return flat


def AsyncGRPOConfig(**kwargs: Any) -> RunConfig:  # noqa: N802 - reads like the class it builds
    """Build a validated `RunConfig` from flat (`learning_rate=`) or dotted keys."""
    flat = _flat_fields()
    data: dict[str, Any] = {}
    for key, value in kwargs.items():
        path = key if "." in key else flat.get(key)
        if path is None:
            close = difflib.get_close_matches(key, list(flat), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown AsyncGRPOConfig argument '{key}'{hint}")
        node = data
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return build_config(data)


class AsyncGRPOTrainer:
    """Asynchronous GRPO on a model, reward functions and a prompt dataset."""

    def __init__(
        self,
        model: Any = None,
        reward_funcs: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        args: RunConfig | None = None,
        processing_class: Any = None,
    ):
        self.args = args or RunConfig()
        if reward_funcs is not None and not isinstance(reward_funcs, list | tuple):
            reward_funcs = [reward_funcs]
        self.model = model
        self.reward_funcs = list(reward_funcs) if reward_funcs is not None else None
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tokenizer = processing_class
        self.run_dir: Path | None = None

    def train(self, resume_from: str | Path | None = None) -> Path:
        """Run training; returns the run directory (metrics, checkpoints, plots)."""
        from asyncgrpo.run import train

        self.run_dir = train(
            self.args,
            resume=resume_from,
            model=self.model,
            tokenizer=self.tokenizer,
            reward_funcs=self.reward_funcs,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
        )
        return self.run_dir
