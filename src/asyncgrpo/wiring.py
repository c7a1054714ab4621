"""Build a `Pipeline` from a `RunConfig` and optional user objects.

Config names are resolved here: the model (`smollm2-135m`, a directory, a hub
id), the dataset spec, the reward functions (built-in names or dotted paths), an agent rollout
(`agent.rollout`, a dotted path, or `rollout_func=`: groups of episodes instead).
Objects passed by the Python API (`AsyncGRPOTrainer(model=..., reward_funcs=...,
train_dataset=...)`) take precedence over the config's names.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import yaml

from asyncgrpo.config import RunConfig
from asyncgrpo.engine.process import EngineProcess
from asyncgrpo.pipeline import Pipeline

logger = logging.getLogger(__name__)


def _model_dir(cfg: RunConfig, model: Any, run_dir: Path) -> str:
    """A directory the engine process can load: the resolved name, or the user's model saved."""
    if model is None or isinstance(model, str | Path):
        from asyncgrpo.models import resolve_model

        return str(resolve_model(str(model or cfg.model.name_or_path)))
    target = run_dir / "initial_model"
    if not (target / "config.json").exists():
        model.save_pretrained(target)
    return str(target)


def _engine_process(cfg: RunConfig, model_dir: str, run_dir: Path) -> EngineProcess | None:
    """The embedded engine's child process (not started), or None for an external engine."""
    e = cfg.engine
    if e.type == "external":
        return None
    return EngineProcess(
        model_dir,
        dtype=cfg.model.engine_dtype(),
        num_threads=e.num_threads,
        max_num_seqs=e.max_num_seqs,
        max_model_len=e.max_model_len,
        prefix_cache_tokens=e.prefix_cache_tokens,
        log_path=run_dir / "engine.log",
    )


def build_pipeline(
    cfg: RunConfig,
    *,
    resume: str | Path | None = None,
    model: Any = None,
    tokenizer: Any = None,
    reward_funcs: list | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    rollout_func: Any = None,
) -> Pipeline:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.metrics.tracker import MetricsTracker
    from asyncgrpo.rollout.data import load_prompts
    from asyncgrpo.rollout.rewards import RewardRunner

    funcs = reward_funcs if reward_funcs is not None else list(cfg.rewards)
    agent = rollout_func is not None or cfg.agent.rollout is not None
    if agent and len(cfg.advantage.reward_weights or [1.0]) != 1:
        raise ValueError("advantage.reward_weights: an agent run has one reward (the rollout's)")
    if not funcs and not agent:
        raise ValueError("no reward functions: set `rewards:` in the recipe or pass reward_funcs")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    run_dir = Path(resume) if resume else Path(cfg.output_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))

    model_dir = _model_dir(cfg, model, run_dir)
    # The engine process loads its copy of the model while this one loads the trainer's.
    engine = _engine_process(cfg, model_dir, run_dir)
    if engine is not None:
        engine.start()
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if model is None or isinstance(model, str | Path):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.float()

        if train_dataset is None:
            train_dataset, loaded_eval = load_prompts(cfg.dataset, cfg.seed)
            eval_dataset = eval_dataset if eval_dataset is not None else loaded_eval
        tracker = MetricsTracker(
            run_dir, overwrite=resume is None, report_to=cfg.report_to, config=cfg.model_dump()
        )
        return Pipeline(
            cfg,
            model=model,
            tokenizer=tokenizer,
            train_rows=train_dataset,
            eval_rows=eval_dataset,
            reward_runner=RewardRunner(funcs) if funcs else None,
            tracker=tracker,
            run_dir=run_dir,
            engine=engine,
            rollout_func=rollout_func,
        )
    except BaseException:
        if engine is not None:
            engine.stop()
        raise
