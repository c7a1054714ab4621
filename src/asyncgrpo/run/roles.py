"""A run's roles from its config's names: model, engine, trainer, rewards, group builder.

Config names are resolved here: the model (`smollm2-135m`, a directory, a hub
id), the dataset spec, the reward functions (built-in names or dotted paths),
an agent rollout (`agent.rollout`, a dotted path, or `rollout_func=`: groups of
episodes instead), the Ray placement. Objects passed by the Python API
(`AsyncGRPOTrainer(model=..., reward_funcs=..., train_dataset=...)`) take precedence
over the config's names. `build.py` calls these in order and assembles the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncgrpo.base.config import ConfigError, RunConfig
from asyncgrpo.inference.backend import EngineBackend, make_backend
from asyncgrpo.learning.environments import episode_source
from asyncgrpo.learning.rollout.data import DatasetError, dataset_rows, load_prompts
from asyncgrpo.learning.rollout.rewards import RewardRunner, RewardSpecError
from asyncgrpo.learning.trainer.build import load_policy, prepare_policy

logger = logging.getLogger(__name__)


def engine_model_dir(cfg: RunConfig, model: Any, tokenizer: Any, run_dir: Path) -> str:
    """A directory the engine process can load: the resolved name, or the user's model saved
    with its tokenizer (`processing_class`, else the one of the directory it came from)."""
    if model is None or isinstance(model, str | Path):
        from asyncgrpo.base.models import resolve_model

        return str(resolve_model(str(model or cfg.model.name_or_path)))
    target = run_dir / "initial_model"
    if not (target / "config.json").exists():
        model.save_pretrained(target)
    if not (target / "tokenizer_config.json").exists():
        _tokenizer_for(model, tokenizer).save_pretrained(target)
    return str(target)


def _tokenizer_for(model: Any, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    source = getattr(model, "name_or_path", "") or ""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        raise ConfigError(
            f"the model object came from {source or 'no directory'!r}, which has no tokenizer "
            "the engine can load: pass processing_class=tokenizer"
        ) from None


def _check(cfg: RunConfig, funcs: list, agent: bool, from_env: bool) -> None:
    if agent and not from_env and len(cfg.advantage.reward_weights or [1.0]) != 1:
        raise ConfigError("advantage.reward_weights: an agent run has one reward (the rollout's)")
    if not funcs and not agent:
        raise ConfigError("no reward functions: set `rewards:` in the recipe or pass reward_funcs")


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Dataset and reward mistakes as `ConfigError`: one line, no traceback on the CLI."""
    try:
        yield
    except (DatasetError, RewardSpecError) as exc:
        raise ConfigError(str(exc)) from None


def _prompt_rows(
    cfg: RunConfig, train: Any, held_out: Any, agent: bool, source: Any
) -> tuple[list, Any]:
    """(train rows, held-out rows or None), read and checked: the recipe's `dataset:` unless
    the API passed datasets, else the environment's own rows."""
    if train is None and not cfg.dataset and getattr(source, "train_rows", None) is not None:
        train = source.train_rows
        held_out = source.eval_rows if held_out is None else held_out
    if train is None:
        train, loaded = load_prompts(cfg.dataset, cfg.seed)
        if held_out is None:
            return train, loaded
    else:
        column = None if agent else cfg.dataset.get("prompt_column", "prompt")
        train = dataset_rows(train, "train_dataset", ("train",), column)
    if held_out is not None:
        column = None if agent else cfg.dataset.get("prompt_column", "prompt")
        held_out = dataset_rows(held_out, "eval_dataset", ("test", "validation", "eval"), column)
    return train, held_out


def _cwd_importable() -> None:
    """Dotted reward paths resolve from the current directory, as in `python -m`: append it
    to sys.path (after installed packages, so it shadows none of them)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def checked_inputs(
    cfg: RunConfig, funcs: list, agent: bool, datasets: tuple, env: tuple | None
) -> tuple:
    """(reward runner, episode source, train rows, held-out rows), every input checked before
    the engine starts; `env` is (tools, environment_factory) when an environment gives the
    episodes, else None."""
    rewards = source = None
    try:
        with _user_errors():
            _check(cfg, funcs, agent, env is not None)
            _cwd_importable()
            rewards = _rewards(cfg, funcs)
            if env is not None:
                source = _source(cfg, rewards, *env)
            return rewards, source, *_prompt_rows(cfg, *datasets, agent, source)
    except BaseException:
        close_started(rewards, None, None, None, source)
        raise


def _source(cfg: RunConfig, rewards: Any, tools: Any, environment_factory: Any) -> Any:
    """The environment's episode source; its reward columns must match `reward_weights`."""
    source = episode_source(
        cfg, reward_funcs=rewards, tools=tools, environment_factory=environment_factory
    )
    weights = cfg.advantage.reward_weights
    names = source.scorer.names if source.scorer is not None else ["reward"]
    if weights is not None and len(weights) != len(names):
        for close in source.closers:
            close()
        raise ConfigError(
            f"advantage.reward_weights has {len(weights)} weights for the rewards {names}"
        )
    return source


def policy_and_tokenizer(
    cfg: RunConfig, model: Any, tokenizer: Any, model_dir: str
) -> tuple[Any, Any]:
    """(the policy to train, its tokenizer): loaded from `model_dir` unless the API passed
    them (a model object is trained in fp32)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if model is None or isinstance(model, str | Path):
        return load_policy(cfg, model_dir), tokenizer
    return prepare_policy(cfg, model.float()), tokenizer


def close_started(rewards: Any, trainer: Any, engine: Any, cluster: Any, source: Any) -> None:
    """Close what a failed `build_run` had started (None: not started)."""
    for close in source.closers if source is not None else []:
        close()
    if rewards is not None:
        rewards.close()
    if trainer is not None:
        trainer.close()
    if engine is not None:
        asyncio.run(engine.close())
    if cluster is not None:
        cluster.shutdown()


def ray_cluster(cfg: RunConfig, run_dir: Path) -> Any:
    """The run's Ray placement (`cluster.launcher: ray`), or None to run everything here."""
    if cfg.cluster.launcher != "ray":
        return None
    from asyncgrpo.run.cluster.placement import RayCluster

    return RayCluster(cfg.cluster, run_dir, cfg.engine.replica_count, cfg.trainer.num_processes - 1)


def trainer_ranks(cfg: RunConfig, cluster: Any) -> tuple[Any, str]:
    """How rank 0 starts the other trainer ranks and the host they reach it at: as actors of
    the Ray cluster, or (None) as child processes here."""
    if cluster is None:
        return None, "127.0.0.1"
    from asyncgrpo.run.cluster.rank_actors import rank_spawner

    return rank_spawner(cluster, cfg.model_dump_json()), cluster.driver_ip


def engine_backend(
    cfg: RunConfig, model_dir: str, run_dir: Path, agent: bool, cluster: Any = None
) -> EngineBackend:
    lora = cfg.model.lora
    engine_cfg = cfg.engine.for_run(model_dir, lora.r if lora else None)
    if cluster is not None:
        from asyncgrpo.run.cluster.engines import ray_engine_backend

        return ray_engine_backend(engine_cfg, cluster, run_dir, cfg.model.name_or_path, agent)
    return make_backend(engine_cfg, run_dir, episodes=agent)


def _rewards(cfg: RunConfig, funcs: list) -> RewardRunner | None:
    r = cfg.rollout
    if not funcs:
        return None
    return RewardRunner(
        funcs,
        timeout_s=r.reward_timeout_s,
        workers=r.reward_workers,
        num_workers=r.reward_num_workers,
    )


def group_builder(cfg: RunConfig, client, tokenizer, rewards, rollout_func, source=None):
    """Agent episodes (an environment's `source`, `agent.rollout`, or a function passed in),
    else single-turn groups."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    a = cfg.agent
    if rollout_func is not None or a.rollout is not None or source is not None:
        from asyncgrpo.learning.rollout.episodes import (
            EpisodeGroupBuilder,
            EpisodeSettings,
            load_rollout,
        )

        settings = EpisodeSettings(
            cfg.rollout.num_generations,
            a.max_turns,
            a.episode_timeout_s,
            a.call_timeout_s,
            a.max_infra_retries,
            dict(a.failure_rewards),
            scored_by_group=source is not None and source.scorer is not None,
        )
        if cfg.rollout.max_prompt_length is not None:
            logger.warning(
                "rollout.max_prompt_length applies to single-turn rollouts only: "
                "agent episodes ignore it (engine.max_model_len bounds them)"
            )
        if source is not None:
            graders = None if source.scores_with_rewards else rewards
            return EpisodeGroupBuilder(
                client,
                source.rollout,
                settings,
                decode,
                graders=graders,
                advantage=cfg.advantage,
                scorer=source.scorer,
            )
        fn = rollout_func or load_rollout(a.rollout)
        return EpisodeGroupBuilder(
            client, fn, settings, decode, graders=rewards, advantage=cfg.advantage
        )
    from asyncgrpo.learning.rollout.single_turn import SingleTurnBuilder

    sampling = cfg.rollout.sampling(cfg.seed)
    return SingleTurnBuilder(client, tokenizer, rewards, sampling, cfg.advantage)
