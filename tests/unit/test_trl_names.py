"""TRL's `GRPOConfig` names in `AsyncGRPOConfig`, recipes and `--set`: each lands on the
field that means the same, values converted where TRL counts differently, a note where the
meaning differs, and every name without an equivalent in one error."""

import logging

import pytest

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.base.config import ConfigError, build_config, load_config, trl_names


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    monkeypatch.setattr(trl_names, "_noted", set())


@pytest.mark.parametrize(
    ("trl", "path", "expected"),
    [
        ({"max_completion_length": 96}, "rollout.max_tokens", 96),
        ({"loss_type": "dr_grpo"}, "loss.aggregation", "dr_grpo"),
        ({"loss_type": "bnpo"}, "loss.aggregation", "bnpo"),
        ({"loss_type": "cispo"}, "loss.name", "cispo"),
        ({"epsilon": 0.1}, "loss.epsilon_low", 0.1),
        ({"epsilon": 0.1}, "loss.epsilon_high", 0.1),  # TRL: epsilon_high defaults to it
        ({"epsilon": 0.1, "epsilon_high": 0.4}, "loss.epsilon_high", 0.4),
        ({"importance_sampling_level": "sequence"}, "loss.ratio_level", "sequence"),
        ({"save_steps": 7}, "checkpoint_steps", 7),
        ({"save_total_limit": 5}, "save_total_limit", 5),
        ({"save_total_limit": None}, "save_total_limit", None),
        ({"per_device_train_batch_size": 16}, "coordinator.batch_groups", 2),
        (
            {
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 4,
                "num_generations": 4,
            },
            "coordinator.batch_groups",
            4,
        ),
        ({"bf16": False}, "trainer.bf16_autocast", False),
        ({"warmup_ratio": 0.1, "max_steps": 30}, "trainer.warmup_steps", 3),
        ({"lr_scheduler_type": "cosine"}, "trainer.lr_schedule", "cosine"),
        ({"lr_scheduler_type": "constant_with_warmup"}, "trainer.lr_schedule", "constant"),
        ({"run_name": "mine"}, "name", "mine"),
        ({"use_vllm": True}, "engine.type", "vllm"),
        ({"use_vllm": False}, "engine.type", "embedded"),
        (
            {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://h:8000"},
            "engine.base_url",
            "http://h:8000",
        ),
        ({"use_vllm": True, "vllm_mode": "server"}, "engine.base_url", "http://127.0.0.1:8000"),
        (
            {"use_vllm": True, "vllm_mode": "server", "vllm_server_port": 9000},
            "engine.base_url",
            "http://127.0.0.1:9000",
        ),
        (
            {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "10.1.2.3"},
            "engine.base_url",
            "http://10.1.2.3:8000",
        ),
        ({"use_vllm": True}, "engine.base_url", None),
        ({"report_to": "none"}, "report_to", []),
        ({"report_to": "tensorboard"}, "report_to", ["tensorboard"]),
        ({"scale_rewards": False}, "advantage.scale_rewards", "none"),
        ({"scale_rewards": True}, "advantage.scale_rewards", "group"),
        ({"scale_rewards": "batch"}, "advantage.scale_rewards", "batch"),
        ({"learning_rate": 3e-6}, "trainer.learning_rate", 3e-6),
        ({"mask_truncated_completions": True}, "loss.mask_truncated_completions", True),
        ({"max_prompt_length": 512}, "rollout.max_prompt_length", 512),
        ({"top_k": 0}, "rollout.top_p", 1.0),  # TRL's defaults: disabled, nothing to set
        ({"top_k": None}, "rollout.top_p", 1.0),
        ({"top_k": -1}, "rollout.top_p", 1.0),
        ({"repetition_penalty": 1.0}, "rollout.top_p", 1.0),
    ],
)
def test_each_trl_name_lands_on_its_field(trl, path, expected):
    node = AsyncGRPOConfig(**trl)
    for part in path.split("."):
        node = getattr(node, part)
    assert node == expected


def test_notes_where_the_meaning_differs_are_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="asyncgrpo.base.config.trl_names")
    for _ in range(2):
        AsyncGRPOConfig(per_device_train_batch_size=16, warmup_ratio=0.1, logging_steps=5)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 3, notes
    assert any("16 completions per step" in n and "batch_groups=2" in n for n in notes)
    assert any("trainer.warmup_steps=5 (of max_steps=50)" in n for n in notes)
    assert any("logging_steps" in n and "every step" in n for n in notes)
    caplog.clear()
    AsyncGRPOConfig(max_completion_length=64, save_steps=3)  # same meaning: no note
    assert not caplog.records


def test_names_without_an_equivalent_are_listed_in_one_error():
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig(
            top_k=50,
            repetition_penalty=1.1,
            num_train_epochs=3,
            loss_type="sapo",
            lr_scheduler_type="polynomial",
            learnin_rate=1e-5,
        )
    message = str(err.value)
    for name in (
        "top_k=50 (TRL) has no equivalent here: rollout sampling has temperature and top_p "
        "only (the trainer recomputes log-probs of the engine's distribution); leave it at 0",
        "repetition_penalty=1.1 (TRL) has no equivalent here",
        "'num_train_epochs'",
        "loss_type='sapo'",
        "lr_scheduler_type='polynomial'",
        "did you mean 'learning_rate' ('trainer.learning_rate')",
    ):
        assert name in message, (name, message)
    assert "unknown key 'loss_type'" not in message  # reported once, for its value
    assert "max_steps" in message  # what to use instead


def test_batch_size_that_does_not_split_into_groups_is_refused():
    with pytest.raises(ConfigError, match=r"10 completions per step must be a multiple of "):
        AsyncGRPOConfig(per_device_train_batch_size=10, num_generations=4)


def test_bad_trl_values_are_named():
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig(per_device_train_batch_size="8", warmup_ratio=2)
    assert "per_device_train_batch_size must be a positive integer (got '8')" in str(err.value)
    assert "warmup_ratio must be a number in [0, 1] (got 2)" in str(err.value)


def test_misplaced_trl_names_point_to_the_right_field():
    with pytest.raises(ConfigError, match=r"'trainer.loss_type'; TRL's 'loss_type' is 'loss.agg"):
        build_config({"trainer": {"loss_type": "dapo"}})
    with pytest.raises(ConfigError, match=r"'trainer.save_steps'; TRL's 'save_steps' is 'checkp"):
        build_config({"trainer": {"save_steps": 3}})
    with pytest.raises(ConfigError) as err:
        build_config({"trainer": {"logging_steps": 3}})
    # no hint to a wrong field (it once said 'checkpoint_steps'): the section's keys
    assert "unknown key 'trainer.logging_steps'; valid keys: learning_rate," in str(err.value)
    with pytest.raises(ConfigError, match=r"'logging_step'; did you mean 'logging_steps'\?$"):
        build_config({"logging_step": 3})
    with pytest.raises(ConfigError, match=r"TRL's 'max_prompt_length' is 'rollout.max_prompt_"):
        build_config({"trainer": {"max_prompt_length": 3}})


def test_recipes_and_set_take_flat_and_trl_names(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "learning_rate: 2.0e-5\nmax_completion_length: 32\n"
        "trainer:\n  num_threads: 2\n  micro_batch_tokens: 128\n"
    )
    cfg = load_config(path, ["save_steps=4", "max_staleness=0", "loss_type=dr_grpo"])
    assert cfg.trainer.learning_rate == 2e-5 and cfg.trainer.num_threads == 2
    assert cfg.rollout.max_tokens == 32 and cfg.checkpoint_steps == 4
    assert cfg.coordinator.max_staleness == 0 and cfg.loss.aggregation == "dr_grpo"
    # a flat --set overrides the recipe's nested value
    assert load_config(path, ["micro_batch_tokens=64"]).trainer.micro_batch_tokens == 64
    with pytest.raises(ConfigError, match=r"several sections, give one: engine.num_threads, tr"):
        load_config(path, ["num_threads=3"])
    with pytest.raises(
        ConfigError, match=r"did you mean 'learning_rate' \('trainer.learning_rate'"
    ):
        build_config({}, ["learning_rat=1e-5"])


def test_epsilon_is_trls_clip_not_the_advantage_epsilon():
    cfg = AsyncGRPOConfig(epsilon=0.3)
    assert cfg.advantage.epsilon == 1e-4 and cfg.loss.epsilon_low == 0.3
    assert AsyncGRPOConfig(**{"advantage.epsilon": 1e-3}).advantage.epsilon == 1e-3


def test_resume_from_checkpoint_takes_trls_forms(tmp_path, monkeypatch):
    """True: this config's run; a run directory; its newest checkpoint; an older one is
    refused naming the newest (a run resumes from its newest checkpoint only)."""
    import asyncgrpo.run.loop
    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.base.config import ConfigError

    resumed = []
    monkeypatch.setattr(
        asyncgrpo.run.loop, "train", lambda cfg, resume, **kw: resumed.append(resume)
    )
    run = tmp_path / "mine"
    for step in ("step-000002", "step-000004"):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / "state.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("step-000004")
    args = AsyncGRPOConfig(output_dir=str(tmp_path), name="mine")
    trainer = AsyncGRPOTrainer(model="smollm2-135m", reward_funcs=[len], args=args)
    trainer.train(resume_from_checkpoint=True)
    trainer.train(resume_from_checkpoint=str(run))
    trainer.train(resume_from_checkpoint=str(run / "checkpoints" / "step-000004"))
    assert resumed == [run, run, run]
    with pytest.raises(ConfigError, match="newest checkpoint \\(step-000004\\)"):
        trainer.train(resume_from_checkpoint=str(run / "checkpoints" / "step-000002"))


IS = "vllm_importance_sampling_"


@pytest.mark.parametrize(
    ("trl", "loss"),
    [
        # TRL's token_mask: ρ kept (as the weight) inside [C_min, C_max], 0 outside
        (
            {IS + "mode": "token_mask", IS + "clip_min": 0.5, IS + "clip_max": 5.0},
            {"correction": "masked_is", "masked_is_low": 0.5, "masked_is_high": 5.0},
        ),
        (
            {IS + "mode": "token_truncate", IS + "clip_max": 2.5},
            {"correction": "token_truncate", "correction_cap": 2.5},
        ),
        (  # TRL's clip_max defaults to 3; the deprecated cap is an alias
            {IS + "mode": "sequence_truncate"},
            {"correction": "sequence_truncate", "correction_cap": 3.0},
        ),
        ({IS + "mode": "token_truncate", IS + "cap": 1.5}, {"correction_cap": 1.5}),
        ({IS + "mode": "sequence_mask", IS + "correction": False}, {"correction": "none"}),
        ({IS + "correction": False, IS + "clip_max": 4.0}, {"correction": "none"}),
    ],
)
def test_trl_importance_sampling_lands_on_the_correction(trl, loss):
    cfg = AsyncGRPOConfig(**trl)
    assert {key: getattr(cfg.loss, key) for key in loss} == loss


def test_trl_importance_sampling_without_an_equivalent_is_refused():
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig(**{IS + "mode": "sequence_mask"})
    assert "weighs a kept sequence by its ratio" in str(err.value)
    with pytest.raises(ConfigError, match=r"token_mask'.*needs vllm_importance_sampling_clip_min"):
        AsyncGRPOConfig(**{IS + "mode": "token_mask", IS + "clip_max": 5.0})
    with pytest.raises(ConfigError, match=r"clips from above only"):
        AsyncGRPOConfig(**{IS + "mode": "token_truncate", IS + "clip_min": 0.5})
    with pytest.raises(ConfigError, match=r"need vllm_importance_sampling_mode"):
        AsyncGRPOConfig(**{IS + "clip_max": 5.0})
    with pytest.raises(ConfigError, match=r"masked_is_low"):  # our bounds: 0 < low < 1
        AsyncGRPOConfig(**{IS + "mode": "token_mask", IS + "clip_min": 0.0, IS + "clip_max": 2.0})
    assert AsyncGRPOConfig(**{IS + "correction": True}).loss.correction == "token_truncate"
