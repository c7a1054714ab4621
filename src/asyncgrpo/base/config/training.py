"""The sections that say how samples are trained on: loss, advantage, trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncgrpo.base.config.base import Section

# The keys of the trainer's loss registry (`trainer/losses.py:LOSSES`; a unit test keeps the
# two equal), named here so that validating a recipe needs neither torch nor the trainer.
LOSS_NAMES = ("clipped", "cispo", "decoupled_ppo")


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
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "masked_is"
    ] = "token_truncate"
    """Behaviour-policy correction from engine vs trainer log-probs (`trainer/corrections.py`).
    `masked_is`: a token whose ratio ρ = π_trainer/π_engine leaves [masked_is_low,
    masked_is_high] on either side carries no gradient, one inside is weighted by ρ (IcePop);
    `token_mask` instead keeps [1/C, C] and weighs the tokens inside by 1."""
    correction_cap: float = Field(2.0, gt=0)
    """Cap C of the behaviour-correction weights."""
    masked_is_low: float = Field(0.5, gt=0, lt=1)
    """α of `correction: masked_is`: tokens with ρ < α carry no gradient. 0.5 is IcePop's
    (Ring-1T report), and the lower bound of verl's masked-IS presets."""
    masked_is_high: float = Field(5.0, gt=1)
    """β of `correction: masked_is`: tokens with ρ > β carry no gradient. 5.0 is IcePop's
    (Ring-1T report); verl's masked-IS presets use 2.0."""
    trust_region: Literal["clip", "m2"] = "clip"
    """How far the update may lean on stale tokens. `clip`: ε-clipping of the policy ratio
    (`epsilon_low`, `epsilon_high`). `m2`: M2PO's second-moment bound
    (`trainer/trust_region.py`): over the whole step's loss tokens, the mean of
    (log π_θ/π_engine)², π_θ as the step starts, is kept at or below `m2_threshold` by
    masking the tokens with the largest squared log-ratio; the others are not ε-clipped.
    Logged per step: `m2_before`, `m2_after`, `m2_masked_fraction`. Costs a no-grad
    forward when the step is more than one micro-batch or runs on several ranks."""
    m2_threshold: float = Field(0.04, gt=0)
    """τ of `trust_region: m2`: the largest mean squared log-ratio a step may train on (0.04:
    the budget of the M2PO authors' training scripts and of AReaL's M2PO example)."""
    opsm_delta: float | None = Field(None, ge=0)
    """Off-policy sequence masking threshold; None disables it."""
    beta: float = Field(0.0, ge=0)
    """Coefficient of the k3 KL to a frozen reference, the initial policy (0: none is made).
    The reference costs one more forward per micro-batch (no backward) and, for full
    fine-tuning, one more copy of the model in memory; under LoRA it is the base model
    with the adapter disabled, so nothing is copied. The step's mean k3 is logged as `kl`."""
    kl_is_correction: bool = False
    """Weight the k3 KL by the detached IS ratio π_θ/π_engine (unbiased under the sampler)."""
    mask_truncated_completions: bool = False
    """Leave completions cut off by `rollout.max_tokens` (finish reason `length`) out of the
    loss, as TRL's option does: their tokens carry no loss and are not counted in the
    step's tokens or sequences, while their rewards still count in their group's
    advantages. TRL keeps them in grpo's and dr_grpo's sequence count (with zero loss)."""

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in LOSS_NAMES:
            raise ValueError(f"unknown loss {value!r}; registered: {sorted(LOSS_NAMES)}")
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
    the advantages (GDPO-style); see `rollout/advantages.py`."""
    epsilon: float = Field(1e-4, gt=0)
    """Added to the reward std before dividing."""


class TrainerConfig(Section):
    learning_rate: float = Field(1e-5, ge=0)
    """Peak AdamW learning rate. 0 freezes the weights while everything else runs: the
    diagnostic for the engine-trainer mismatch, whose `mismatch_kl` must then stay flat."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 to the peak learning rate."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warmup."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch (gradient accumulation splits beyond it).
    The default suits a CPU; on a GPU larger is faster while memory lasts (H100,
    Qwen2.5-0.5B's shape, varlen attention: 1.15 s a step at 16,384, 0.95 s at 32,768)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer's weights, optimizer and forward live. `auto`: a CUDA GPU when
    there is one (rank r takes GPU `LOCAL_RANK` mod the GPUs it sees), else the CPU.
    The engine is placed by its own section: an embedded engine runs on the CPU, vLLM on
    the GPUs `engine.vllm_env` gives it."""
    attention: Literal["auto", "segments", "varlen", "mask"] = "auto"
    """How a packed micro-batch attends (`trainer/packing.py`). `segments`: one attention
    call per sequence segment (work Σ Lᵢ²; the CPU's fastest). `mask`: one call over the
    whole packed row with a block mask (work N², one kernel per layer). `varlen`: one
    variable-length flash-attention call per layer over all segments (work Σ Lᵢ²; a GPU
    under bf16/fp16 autocast, else it runs as `segments`; `trainer/varlen.py`). `auto`:
    segments on a CPU; varlen on a GPU where torch has the kernel and the trainer runs
    under autocast (on an H100 a Qwen2.5-0.5B step took 1.15 s against the mask's 2.49 s),
    else mask."""
    bf16_autocast: bool | Literal["auto"] = "auto"
    """Run the trainer's forward under bf16 autocast. `auto`: on a GPU where it has bf16
    (Ampere and later), on a CPU where it multiplies bf16 natively and a timed matmul
    finds bf16 faster than fp32 (`hardware.cpu_bf16_matmul_pays`; with AMX:
    ~2.5x faster forward+backward), off elsewhere (on AVX2-only CPUs bf16 is emulated:
    measured 16x slower than fp32; a VM with AVX512-BF16 but no AMX multiplied bf16 at half
    the fp32 rate). Data-parallel ranks take rank 0's choice."""

    def attention_for(self, device_type: str, varlen_kernel: bool = False) -> str:
        """`attention` resolved for the trainer's device type; `varlen_kernel`: whether
        this torch has the variable-length flash kernel for that device."""
        if self.attention != "auto":
            return self.attention
        if device_type != "cuda":
            return "segments"
        return "varlen" if varlen_kernel and self.use_bf16_autocast(device_type) else "mask"

    def use_bf16_autocast(self, device_type: str = "cpu") -> bool:
        """`bf16_autocast` resolved for this machine and the trainer's device type."""
        if self.bf16_autocast != "auto":
            return bool(self.bf16_autocast)
        if device_type == "cuda":
            import torch

            return torch.cuda.is_bf16_supported()
        from asyncgrpo.base.hardware import cpu_bf16_matmul_pays

        return cpu_bf16_matmul_pays()

    num_threads: int = Field(1, ge=1)
    """torch threads of the trainer process (of each rank)."""
    borrow_engine_threads: bool | Literal["auto"] = "auto"
    """While the engine on this machine has nothing to compute, run the trainer with its
    threads too (`inference/core_share.py`): on 2 cores with the default recipe the engine idles
    ~50% of the time, and borrowing made the run 1.14x faster (median of 3 pairs).
    `auto` (or `true`): on for one trainer process on a CPU beside one embedded engine
    started by the run (not under Ray, replicas or an external server); `false`: off."""
    reuse_freed_memory: bool = True
    """On a CPU, have malloc keep freed memory for reuse (`hardware.keep_freed_memory`):
    no per-step page faults for the large buffers each step allocates again. Default
    recipe, 22 steps, 4 interleaved pairs: 2.92-3.02 against 2.99-3.54 s/step (median
    1.10x), and ~1 GB more resident memory (5.4 against 4.4 GB). Tensors of 2 MB and more
    also go on transparent huge pages where the kernel offers them
    (`hardware.huge_pages_for_large_tensors`). `false` where memory is tight."""
    num_processes: int = Field(1, ge=1)
    """Data-parallel trainer ranks (see `strategy`: ddp by default, or FSDP2). More than
    1: `asyncgrpo train` is rank 0 and starts the others; under `torchrun` /
    `accelerate launch` the launcher's WORLD_SIZE counts instead."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How ranks share the work. `ddp`: each rank holds the whole model and optimizer,
    gradients are averaged (DDP's arithmetic). `fsdp`: FSDP2 shards weights, gradients
    and optimizer state over the ranks, for models that do not fit one device. Both run
    on CPU (gloo) and GPU (NCCL)."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """A rank that waits longer than this in a collective (a peer died or hangs) stops the
    job; `--resume` continues it."""
    compile_layers: bool | Literal["auto"] = "auto"
    """Run each decoder layer under `torch.compile`, its attention eager
    (`trainer/compiled_layers.py`): the norms, rotary embedding, activation and residual
    adds fuse into a few passes. SmolLM2-135M on a 2-core EPYC with AVX512-BF16,
    interleaved steps on the same batches: 1.07-1.10x (median pair ratio); in float32 on
    one without AVX512, 0.89x. `auto`: on for one trainer process on a CPU with a C++
    compiler (inductor builds its kernels with it), under bf16 autocast, for models of
    hidden size >= 512 (smaller ones gain less than the first step's ~6 s of compilation),
    without `gradient_checkpointing`; `true`: the same for any size and dtype; not yet
    with several processes, on a GPU (unmeasured there) or with gradient checkpointing
    (an error). `false`: eager."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory for long completions, about
    a third more compute."""
    old_logprobs: Literal["current", "engine"] = "current"
    """π_old of the clipped ratio: the current policy detached (one step per batch, staleness
    corrected by the behaviour weights) or the engine's log-probs (TRL's async trainer)."""
