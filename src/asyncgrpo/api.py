"""The Python API, in TRL's spirit: a flat config and a trainer with `.train()`.

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    args = AsyncGRPOConfig(max_steps=50, num_generations=8, max_staleness=2, learning_rate=1e-5)
    AsyncGRPOTrainer(model="smollm2-135m", reward_funcs=[my_reward],
                     train_dataset=ds, eval_dataset=held_out, args=args).train()

`AsyncGRPOConfig` takes every field of the typed `RunConfig` by its own name
when it is a top-level field (`name`, `seed`, `max_steps`) or unique across sections
(`learning_rate`, `max_staleness`, `num_generations`, ...), by its dotted path
(`"engine.num_threads"`), or by TRL's `GRPOConfig` name (`max_completion_length`,
`loss_type`, `save_steps`, ...: `base/config/trl_names.py`), and validates exactly like a
YAML recipe, with the same did-you-mean errors, every mistake in one error.

`AsyncGRPOTrainer` takes TRL's arguments: a model name, directory or object (with
`processing_class`, its tokenizer), reward functions (callables, built-in names or
dotted paths), and a `datasets.Dataset`, `DatasetDict` (its `train` split), list of
dicts or data file path, and TRL's `tools=[fn, ...]` and `environment_factory=Cls` (or
`{name: Cls}`), run as episodes through the engine's gateway (`learning/environments/trl.py`).
They are checked before the engine starts. `save_model(dir)`
exports the trained policy as a Hugging Face directory.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from asyncgrpo.base.config import ConfigError, RunConfig, build_config

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
        tools: list | None = None,
        environment_factory: Any = None,
    ):
        self.args = args or RunConfig()
        if reward_funcs is not None and not isinstance(reward_funcs, list | tuple):
            reward_funcs = [reward_funcs]
        self.model = model
        self.reward_funcs = list(reward_funcs) if reward_funcs is not None else None
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.tokenizer = processing_class
        self.tools = tools
        self.environment_factory = environment_factory
        if tools is not None or environment_factory is not None:
            self._check_environment()
        self.run_dir: Path | None = None

    def _check_environment(self) -> None:
        """TRL's `tools=` / `environment_factory=`, checked now rather than at the first
        episode (`learning/environments/trl_classes.py`)."""
        from asyncgrpo.learning.environments.trl_classes import check_tools, read_environments

        check_tools(self.tools)
        kinds = read_environments(self.environment_factory) if self.environment_factory else []
        has_rewards = self.reward_funcs or (self.reward_funcs is None and self.args.rewards)
        if not has_rewards and not any(kind.has_reward for kind in kinds):
            raise ConfigError(
                "no reward source: pass reward_funcs, or an environment_factory class with a "
                "get_reward() method"
            )
        named = any(kind.name is not None for kind in kinds)
        if named and self.train_dataset is None and not self.args.dataset:
            raise ConfigError(
                "environment_factory={name: Class} needs a train_dataset whose `environment` "
                "column picks each row's environment"
            )

    def train(
        self,
        resume_from: str | Path | None = None,
        resume_from_checkpoint: bool | str | Path | None = None,
    ) -> Path:
        """Run training; returns the run directory (metrics, checkpoints, plots).

        `resume_from`: a run directory to continue. `resume_from_checkpoint` (TRL's name):
        True continues this config's run (`output_dir/name`); a path is a run directory
        or its newest checkpoint (a run resumes from its newest checkpoint only)."""
        from asyncgrpo.run.loop import train

        if resume_from_checkpoint:
            resume_from = self._resume_dir(resume_from_checkpoint)
        self.run_dir = train(
            self.args,
            resume=resume_from,
            model=self.model,
            tokenizer=self.tokenizer,
            reward_funcs=self.reward_funcs,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            tools=self.tools,
            environment_factory=self.environment_factory,
        )
        return self.run_dir

    def _resume_dir(self, checkpoint: bool | str | Path) -> Path:
        from asyncgrpo.learning.trainer.checkpoint import latest_checkpoint

        if checkpoint is True:
            return Path(self.args.output_dir) / self.args.name
        path = Path(checkpoint)
        if path.parent.name != "checkpoints":
            return path  # a run directory
        latest = latest_checkpoint(path.parent)
        if latest is None or latest.resolve() != path.resolve():
            raise ConfigError(
                f"resume_from_checkpoint={str(path)!r}: a run resumes from its newest "
                f"checkpoint ({latest.name if latest else 'none'}); pass the run directory "
                f"{path.parent.parent}, or export that step with `asyncgrpo export --step`"
            )
        return path.parent.parent

    def save_model(self, output_dir: str | Path, step: int | None = None) -> Path:
        """Write the trained policy (the best held-out evaluation's weights where the run
        kept them, else the newest checkpoint; or `step`) as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads (under LoRA: the base
        with the adapter merged in). TRL's habit `save_model(args.output_dir)` works too:
        the model files land in `output_dir` beside its run directories."""
        from asyncgrpo.run.export import export_run

        if self.run_dir is None:
            raise RuntimeError("save_model: nothing trained yet; call train() first")
        merged = self.args.model.lora is not None
        out = Path(output_dir)
        if out.resolve() != Path(self.args.output_dir).resolve() or not out.is_dir():
            logger.info("%s", export_run(self.run_dir, out, step=step, merged=merged))
            return out
        with tempfile.TemporaryDirectory(dir=out) as scratch:
            built = Path(scratch) / "model"
            logger.info("%s", export_run(self.run_dir, built, step=step, merged=merged))
            for path in built.iterdir():  # a previous save's files are replaced
                os.replace(path, out / path.name)
        return out
