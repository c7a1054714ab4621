"""The Python API, in TRL's spirit: a flat config and a trainer with `.train()`.

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    args = AsyncGRPOConfig(max_steps=50, num_generations=8, max_staleness=2, learning_rate=1e-5)
    AsyncGRPOTrainer(model="smollm2-135m", reward_funcs=[my_reward],
                     train_dataset=ds, eval_dataset=held_out, args=args).train()

`AsyncGRPOConfig` takes every field of the typed `RunConfig` by its own name
when it is a top-level field (`name`, `seed`, `max_steps`) or unique across sections
(`learning_rate`, `max_staleness`, `num_generations`, ...), by its dotted path
(`"engine.num_threads"`), or by TRL's `GRPOConfig` name (`max_completion_length`,
`loss_type`, `save_steps`, ...: `config/trl_names.py`), and validates exactly like a
YAML recipe, with the same did-you-mean errors, every mistake in one error.

`AsyncGRPOTrainer` takes TRL's arguments: a model name, directory or object (with
`processing_class`, its tokenizer), reward functions (callables, built-in names or
dotted paths), and a `datasets.Dataset`, `DatasetDict` (its `train` split), list of
dicts or data file path. They are checked before the engine starts. `save_model(dir)`
exports the trained policy as a Hugging Face directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asyncgrpo.config import RunConfig, build_config

logger = logging.getLogger(__name__)


def AsyncGRPOConfig(**kwargs: Any) -> RunConfig:  # noqa: N802 - reads like the class it builds
    """Build a validated `RunConfig` from flat (`learning_rate=`), TRL or dotted keys."""
    data: dict[str, Any] = {}
    for key, value in kwargs.items():
        node = data
        *parents, leaf = key.split(".")
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

    def save_model(self, output_dir: str | Path, step: int | None = None) -> Path:
        """Write the trained policy (the newest checkpoint, or `step`) as a Hugging Face
        directory that `AutoModelForCausalLM.from_pretrained` loads (under LoRA: the base
        with the adapter merged in)."""
        from asyncgrpo.export import export_run

        if self.run_dir is None:
            raise RuntimeError("save_model: nothing trained yet; call train() first")
        merged = self.args.model.lora is not None
        logger.info("%s", export_run(self.run_dir, output_dir, step=step, merged=merged))
        return Path(output_dir)
