"""Several Tinker LoRA training models on one base model, in one process.

Each `create_lora_training_client` of the Tinker API is a LoRA adapter of its own on the
server's single base model (peft's multi-adapter model: `add_adapter` / `set_adapter`),
with its own AdamW state. A model is trained through the trainer's primitives
(`PolicyTrainer.forward` / `forward_backward` / `optim_step`), one `PolicyTrainer` per
model over the shared peft model, so the Tinker front door runs the very forward and
backward code of `asyncgrpo train`.

Isolation rests on peft's `set_adapter`: only the active adapter's factors require grad,
so a model's backward leaves every other adapter's pending gradients alone, and its
`optim_step` clips and steps only its own parameters (its optimizer holds nothing else).
Each operation activates its model's adapter under one lock: one operation at a time on
the shared base. A model may leave memory between operations (`unload`, when
`offload.py` sends it to disk) and come back (`reload`) exactly as it was: its adapter is
injected again under its name and filled, its Adam state and pending gradients restored,
while its `PolicyTrainer` (step count included) stays in memory throughout.

Departures from a single-model `PolicyTrainer`: a Tinker datum (model input x and
`target_tokens` y, both of length N, y[i] predicted from x[:i+1]) becomes
`TrainDatum(x + [y[-1]], loss_start=1, targets=y)`; losses are Tinker's own
(`losses.py`, sum-reduced); `lora_alpha` is fixed at 32 (Tinker's convention; the scale
alpha/r is baked into B for the engine, `adapters.py`).
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig
from asyncgrpo.learning.trainer.datums import (
    AdamParams,
    LossFn,
    MicroBatch,
    TrainDatum,
    padded_inputs,
)
from asyncgrpo.learning.trainer.logprobs import lm_head_token_logprobs
from asyncgrpo.learning.trainer.lora import import_peft, linear_module_names
from asyncgrpo.learning.trainer.packing import pad_ragged
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.lora_state import (
    adapter_factors,
    gradient_tensors,
    load_adapter,
    load_gradients,
    load_optimizer,
    optimizer_tensors,
    sampler_factors,
)
from asyncgrpo.tinker.losses import MetricTotals, TinkerLoss, make_loss

if TYPE_CHECKING:
    from asyncgrpo.tinker.wire import TinkerDatum

LORA_ALPHA = 32
MODEL_ID_FIELD = "model_id"
DATA_FIELD = "forward_backward_input.data"
TARGETS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}
"""The linear modules each `LoraConfig` flag adds an adapter to (Llama-family names)."""


@dataclass(frozen=True)
class LoraSpec:
    """A model's `lora_config` as `create_model` sends it."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def target_modules(self) -> list[str]:
        return [name for flag, names in TARGETS.items() if getattr(self, flag) for name in names]


@dataclass
class TinkerOutput:
    """A `forward` / `forward_backward` result: per datum the learner's log-prob of each
    target token ((N,) float32), and metrics keyed `name:reduction`."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float]


@dataclass
class ModelState:
    """A model saved as plain values: `tensors` (adapter factors under peft's saved names,
    unscaled, and `optimizer.<name>.<key>` Adam moments) for safetensors; `spec` and `meta`
    (steps taken, whether the optimizer is in) for JSON."""

    spec: dict
    tensors: dict[str, torch.Tensor]
    meta: dict


@dataclass
class _Model:
    adapter: str  # the peft adapter name (model ids may hold characters peft refuses)
    spec: LoraSpec
    trainer: PolicyTrainer
    resident: bool = True  # False while its adapter and optimizer are out of memory


class LoraModels:
    """LoRA training models by model id, all on one base model."""

    def __init__(self, base: torch.nn.Module, trainer_cfg: TrainerConfig | None = None):
        """`base`: a Hugging Face causal LM, on the device it trains on. `trainer_cfg`: the
        trainer's device-side settings (micro-batch token budget, attention, bf16)."""
        self.base = base
        self.linear_modules = set(linear_module_names(base))  # before peft wraps them
        self.trainer_cfg = trainer_cfg or TrainerConfig()
        self.peft_model = None  # the peft wrapper, made by the first create
        self.models: dict[str, _Model] = {}
        self.lock = threading.RLock()
        self._adapters = 0

    def create(
        self,
        model_id: str,
        rank: int,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> None:
        """A new model with a fresh adapter (A random from `seed`, B zero) and Adam state."""
        spec = LoraSpec(rank, seed, train_mlp, train_attn, train_unembed)
        with self.lock:
            if model_id in self.models:
                raise TinkerUserError(MODEL_ID_FIELD, f"model {model_id!r} already exists")
            self._check_spec(spec)
            adapter = f"tinker_{self._adapters}"
            self._adapters += 1
            self._add_adapter(adapter, spec)
            self.peft_model.set_adapter(adapter)
            trainer = PolicyTrainer(
                self.peft_model,
                self.trainer_cfg,
                LossConfig(),
                AdvantageConfig(),
                max_steps=1,  # unused: Tinker's optim_step passes its numbers, no schedule
            )
            trainer.runner = functools.partial(run_packed_with_head_adapter, self.peft_model)
            self.models[model_id] = _Model(adapter, spec, trainer)

    def remove(self, model_id: str) -> None:
        """Forget a model: its adapter leaves the base model, its gradients and Adam state
        go with its trainer (the last adapter too: peft then runs the bare base)."""
        with self.lock:
            model = self._model(model_id, resident=False)
            del self.models[model_id]
            if model.resident:
                model.trainer.optimizer.zero_grad(set_to_none=True)
                self.peft_model.delete_adapter(model.adapter)

    def spec(self, model_id: str) -> LoraSpec:
        with self.lock:
            return self._model(model_id, resident=False).spec

    def steps(self, model_id: str) -> int:
        """The optimizer steps this model has taken (restored ones included)."""
        with self.lock:
            return int(self._model(model_id, resident=False).trainer.version)

    def is_resident(self, model_id: str) -> bool:
        with self.lock:
            return self._model(model_id, resident=False).resident

    def resident_count(self) -> int:
        """The models whose adapter and Adam state are in memory (without the lock, which an
        operation holds while it runs: read by metrics scrapes on the event loop)."""
        return sum(model.resident for model in list(self.models.values()))

    def memory_tensors(self, model_id: str) -> dict[str, torch.Tensor]:
        """Copies of all a model holds in memory as tensors, by `lora_state`'s names: its
        adapter's factors, Adam moments and pending gradients."""
        with self.lock:
            model = self._model(model_id)
            factors = adapter_factors(self.peft_model, model.adapter)
            tensors = {name: t.detach().clone() for name, t in factors.items()}
            tensors.update(optimizer_tensors(model.trainer.optimizer, factors))
            tensors.update(gradient_tensors(factors))
            return tensors

    def unload(self, model_id: str) -> None:
        """Take the model out of memory: its adapter leaves the peft model, its optimizer
        (Adam state) and gradients are released; its spec and trainer (step count) stay."""
        with self.lock:
            model = self._model(model_id)
            model.trainer.optimizer.zero_grad(set_to_none=True)
            model.trainer.optimizer = model.trainer.scheduler = None
            self.peft_model.delete_adapter(model.adapter)
            model.resident = False

    def reload(self, model_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Bring an unloaded model back from its `memory_tensors`, as it was."""
        with self.lock:
            model = self._model(model_id, resident=False)
            if model.resident:
                raise ValueError(f"model {model_id!r} is already in memory")
            self._add_adapter(model.adapter, model.spec)  # values replaced just below
            self.peft_model.set_adapter(model.adapter)
            factors = load_adapter(self.peft_model, model.adapter, tensors)
            model.trainer.build_optimizer()  # over the new parameters, as at its creation
            load_optimizer(model.trainer.optimizer, factors, tensors)
            load_gradients(factors, tensors)
            model.resident = True

    def forward(
        self, model_id: str, datums: Sequence[TinkerDatum], loss_fn: str, config=None
    ) -> TinkerOutput:
        """Log-probs and the loss's metrics of `datums`, without gradients."""
        loss = make_loss(loss_fn, config)
        train_datums = train_datums_for(datums, loss)
        with self.lock:
            trainer = self._activate(model_id)
            logprobs = trainer.forward(train_datums)
            metrics = MetricTotals()
            if any(len(lp) for lp in logprobs):
                padded, mask = pad_ragged(logprobs)  # (B, T)
                inputs = padded_inputs(train_datums, padded.device)
                _, metrics = loss(padded, mask, inputs)
            else:
                metrics.add_sum("loss", 0.0)
        return TinkerOutput(_numpy(logprobs), metrics.result())

    def forward_backward(
        self, model_id: str, datums: Sequence[TinkerDatum], loss_fn: str, config=None
    ) -> TinkerOutput:
        """Forward and backward of `loss_fn` over `datums`; gradients accumulate in this
        model's adapter until its `optim_step`."""
        loss = make_loss(loss_fn, config)
        train_datums = train_datums_for(datums, loss)
        metrics = MetricTotals()
        metrics.add_sum("loss", 0.0)
        with self.lock:
            trainer = self._activate(model_id)
            result = trainer.forward_backward(train_datums, trainer_loss(loss, metrics))
        return TinkerOutput(_numpy(result.logprobs), metrics.result())

    def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, float]:
        """One AdamW step of this model on its accumulated gradients (clipped to
        `adam.grad_clip_norm` when > 0), which it then clears."""
        with self.lock:
            trainer = self._activate(model_id)
            grad_norm = trainer.optim_step(adam)
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": adam.learning_rate}

    def sampler_weights(
        self, model_id: str, dtype: torch.dtype | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """The adapter in the engine's sync format (`adapters.py`): peft saved names,
        B scaled by alpha/r; detached copies, cast to `dtype` when given."""
        with self.lock:
            model = self._model(model_id)
            return sampler_factors(self.peft_model, model.adapter, dtype)

    def state(self, model_id: str) -> ModelState:
        """This model's adapter, Adam state and step count as plain tensors and dicts."""
        with self.lock:
            model = self._model(model_id)
            factors = adapter_factors(self.peft_model, model.adapter)
            tensors = {name: t.detach().clone() for name, t in factors.items()}
            tensors.update(optimizer_tensors(model.trainer.optimizer, factors))
            meta = {"steps": model.trainer.version}
            return ModelState(asdict(model.spec), tensors, meta)

    def load_state(self, model_id: str, state: ModelState, with_optimizer: bool) -> None:
        """Load `state` into the existing model `model_id` (created with the same
        `LoraSpec`); pending gradients are dropped. Without the optimizer, Adam starts
        afresh."""
        with self.lock:
            model = self._model(model_id)
            if LoraSpec(**state.spec) != model.spec:
                raise TinkerUserError(
                    "path",
                    f"the saved model's lora_config {state.spec} differs from model "
                    f"{model_id!r}'s {asdict(model.spec)}",
                )
            trainer = self._activate(model_id)
            trainer.optimizer.zero_grad(set_to_none=True)
            factors = load_adapter(self.peft_model, model.adapter, state.tensors)
            trainer.build_optimizer()  # a fresh Adam over the same parameters
            if with_optimizer:
                load_optimizer(trainer.optimizer, factors, state.tensors)
                trainer.version = int(state.meta.get("steps", 0))

    def _model(self, model_id: str, resident: bool = True) -> _Model:
        """The model; with `resident`, one in memory (the caller brings it back first)."""
        model = self.models.get(model_id)
        if model is None:
            raise TinkerUserError(MODEL_ID_FIELD, f"no model {model_id!r} on this server")
        if resident and not model.resident:
            raise RuntimeError(f"model {model_id!r} is offloaded: reload it before using it")
        return model

    def _activate(self, model_id: str) -> PolicyTrainer:
        """Make `model_id`'s adapter the one that runs and trains; its trainer."""
        model = self._model(model_id)
        self.peft_model.set_adapter(model.adapter)
        return model.trainer

    def _check_spec(self, spec: LoraSpec) -> None:
        if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
            raise TinkerUserError(
                "lora_config.rank", f"must be a positive integer, got {spec.rank}"
            )
        if not spec.target_modules():
            raise TinkerUserError(
                "lora_config",
                "train_mlp, train_attn and train_unembed are all false: nothing trains",
            )
        linear = self.linear_modules
        for flag, names in TARGETS.items():
            missing = [n for n in names if n not in linear]
            if getattr(spec, flag) and missing:
                raise TinkerUserError(
                    f"lora_config.{flag}",
                    f"the base model has no {', '.join(missing)} module; its linear modules "
                    f"are {', '.join(sorted(linear))}",
                )

    def _add_adapter(self, adapter: str, spec: LoraSpec) -> None:
        """Inject `adapter`, its A drawn from `spec.seed` without touching the global RNG."""
        peft = import_peft()
        config = peft.LoraConfig(
            r=spec.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=spec.target_modules(),
        )
        seed = spec.seed if spec.seed is not None else random.SystemRandom().randrange(2**31)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            if self.peft_model is None:
                self.peft_model = peft.get_peft_model(self.base, config, adapter_name=adapter)
            else:
                self.peft_model.add_adapter(adapter, config)


def run_packed_with_head_adapter(
    peft_model, forward, rows, targets, temperature, with_entropy, chunk_rows, top_p
):
    """`packing.run_packed` with the LM head's adapter applied.

    The trainer's fused head (`lm_head_token_logprobs`) reads `lm_head.weight`, which on a
    peft layer is the base weight alone: an `lm_head` adapter (`train_unembed`, Tinker's
    default) would neither act nor train. Here the head is W + Σ scale·B @ A over the
    active adapters, differentiable in A and B, exactly what peft's forward computes."""
    model = peft_model.get_base_model()
    base = getattr(model, model.base_model_prefix)
    hidden = base(**forward).last_hidden_state[0]  # (N, H)
    head = effective_head(model.get_output_embeddings())
    return lm_head_token_logprobs(
        hidden[rows], head, targets, temperature, with_entropy, chunk_rows, top_p
    )


def effective_head(layer):
    """`layer` itself, or for a peft LoRA layer an object with its effective `weight`
    (V, H) (fp32 when an adapter is active: a bf16 base would round the update away)
    and `bias`."""
    if not hasattr(layer, "lora_A") or layer.disable_adapters or layer.merged:
        return layer
    base = layer.base_layer
    weight = base.weight
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A.keys():
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight  # (r, H), (V, r)
            weight = weight.float() + (b @ a) * layer.scaling[adapter]
    return SimpleNamespace(weight=weight, bias=base.bias)


def train_datums_for(datums: Sequence[TinkerDatum], loss: TinkerLoss) -> list[TrainDatum]:
    """`train_datum` of each datum, refusing one without an input `loss` reads."""
    for i, datum in enumerate(datums):
        for name in ("target_tokens", *loss.inputs):
            if name not in datum.inputs:
                raise TinkerUserError(
                    f"{DATA_FIELD}[{i}].loss_fn_inputs.{name}", f"loss_fn {loss.name!r} needs it"
                )
    return [train_datum(d, loss.inputs) for d in datums]


def train_datum(datum: TinkerDatum, input_names: Sequence[str]) -> TrainDatum:
    """The trainer's datum for a Tinker one: position i of the model input predicts
    `target_tokens[i]`; the loss's float inputs ride along per target position."""
    targets = [int(t) for t in datum.inputs["target_tokens"]]
    tokens = [int(t) for t in datum.tokens]
    tail = targets[-1:] or [0]  # the sequence's last token is never read, only scored
    inputs = {name: np.asarray(datum.inputs[name], dtype=np.float32) for name in input_names}
    return TrainDatum(tokens + tail, loss_start=1, targets=targets, inputs=inputs)


def trainer_loss(loss: TinkerLoss, metrics: MetricTotals) -> LossFn:
    """`loss` as the trainer's per-micro-batch loss function; its metrics are summed
    into `metrics` (Tinker's sum and mean reductions, not the trainer's token means)."""

    def per_micro_batch(batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        value, micro_metrics = loss(batch.logprobs, batch.mask, batch.inputs)
        metrics.merge(micro_metrics)
        return value, {}

    return per_micro_batch


def _numpy(logprobs: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [lp.detach().float().cpu().numpy().astype(np.float32) for lp in logprobs]
