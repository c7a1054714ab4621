"""The policy's decoder layers under `torch.compile`, their attention left out.

On a CPU a SmolLM2-135M training step spends ~1.5-2 s of ~6.5 outside its matrix
products, in elementwise passes: RMSNorm's five over each of 61 norms, the rotary
embedding's over q and k, SiLU times the up projection, the residual adds, each forward
and backward, each a trip through memory. Compiled, each layer's runs fuse into a few
loops (RMSNorm forward+backward 8.0 -> 3.6 ms, rotary 8.1 -> 3.0 ms at 3,678 rows).
The layer's attention stays one opaque call (`packing.packed_attention_forward`):
its per-segment loop would otherwise unroll into the graph and recompile for every batch.

`dynamic=True`: packed micro-batches change their row count every step; one graph serves
them all (the layers share it: same code, parameters as inputs). The first step pays the
compilation, ~6 s on 2 cores.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from asyncgrpo.base.config import ConfigError, TrainerConfig
from asyncgrpo.learning.trainer.packing import enable_packed_attention
from asyncgrpo.learning.trainer.sharded import decoder_layers

logger = logging.getLogger(__name__)

COMPILE_MIN_HIDDEN = 512  # `trainer.compile_layers: auto` compiles models this wide or wider


def wanted(
    trainer: TrainerConfig, device_type: str, hidden_size: int, world_size: int, *, bf16: bool
) -> bool:
    """`trainer.compile_layers` resolved for a trainer of `world_size` processes on
    `device_type`, for a model of `hidden_size`, under bf16 autocast or not. `auto` compiles
    bf16 steps only: their casts are what fuse best; float32 steps on a 2-core EPYC without
    AVX512 ran 0.89x compiled (median of 5 interleaved pairs)."""
    if trainer.compile_layers is False:
        return False
    supported = device_type == "cpu" and world_size == 1
    if trainer.compile_layers == "auto":
        wide = hidden_size >= COMPILE_MIN_HIDDEN
        eligible = supported and wide and bf16 and not trainer.gradient_checkpointing
        return eligible and cpp_compiler_found()
    if not supported:
        raise ConfigError(
            "trainer.compile_layers: true runs on one CPU trainer process only, not yet on "
            f"{world_size} process(es) on {device_type} (unmeasured there); set it to auto "
            "or false"
        )
    if trainer.gradient_checkpointing:
        # dynamo runs a checkpointed layer's forward eager: nothing would compile
        raise ConfigError(
            "trainer.compile_layers: true does not work with gradient_checkpointing yet (the "
            "checkpointed layers would run uncompiled); turn one of them off"
        )
    if not cpp_compiler_found():
        raise ConfigError(
            "trainer.compile_layers: true needs a C++ compiler for torch.compile's CPU "
            "kernels (g++, or $CXX); install one, or set it to auto or false"
        )
    return True


def cpp_compiler_found() -> bool:
    """Whether inductor's C++ compiler (`$CXX`, else g++) is on this machine: it builds
    the CPU kernels of a compiled graph."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of `model` in place (state-dict keys unchanged); returns
    how many. The packed attention function, opaque to the compiler, is
    selected on it (`packing.enable_packed_attention`)."""
    enable_packed_attention(model)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    logger.info("compiled %d decoder layers (their attention runs eager)", len(layers))
    return len(layers)
