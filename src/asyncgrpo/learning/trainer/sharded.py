"""`trainer.strategy: fsdp`: the weights, gradients and optimizer state sharded over ranks.

FSDP2 (`torch.distributed.fsdp.fully_shard`) shards each decoder layer and, at the
root, the embeddings, final norm and LM head. The root must be a module whose forward
the packed forward goes through: `packing.run_packed` calls the base model and the
chunked LM head directly, never the causal LM's own forward, so the root is
`PackedRoot`, a thin module around the model whose forward is `run_packed`. A tied LM
head stays tied (it lives in the root's group with the embeddings).

Sharding changes three things for the other modules:
- every forward all-gathers, so all ranks run the same number of micro-batches
  (`Prepared.micro_batches`; short ranks run loss-free filler ones, `grpo_loss.PADDING`);
- gradients are reduce-scattered (averaged) inside backward: no `gradient_sync`;
- publishing and checkpointing gather full tensors (`full`), a collective that every
  rank runs in the same order (`data_parallel.py` sends them the command); loading lays each
  full tensor out like the local shard (`checkpoint.py`, `like`).

gloo runs all of it on CPU (a 2-rank run equals one process, tests/integration);
the same code takes NCCL where the model sits on a GPU.
"""

from __future__ import annotations

import torch

from asyncgrpo.learning.trainer.distributed import require_collective_thread
from asyncgrpo.learning.trainer.packing import run_packed


class PackedRoot(torch.nn.Module):
    """The FSDP root: `run_packed` on the wrapped causal LM, as a module forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.policy = model

    def forward(self, forward, rows, targets, temperature, with_entropy, chunk_rows, top_p):
        logprobs, entropy = run_packed(
            self.policy, forward, rows, targets, temperature, with_entropy, chunk_rows, top_p
        )
        # tensors only: FSDP hooks the outputs for its backward bookkeeping
        return logprobs, entropy if entropy is not None else logprobs.new_zeros(0)


def shard_module(model: torch.nn.Module, mesh) -> PackedRoot:
    """fully_shard each decoder layer of `model`, then a `PackedRoot` around it."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    root = PackedRoot(model)
    fully_shard(root, mesh=mesh)
    return root


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (the classes a HF model lists in `_no_split_modules`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(inner, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"trainer.strategy=fsdp: no decoder layers found in {type(inner).__name__} "
            "(it lists no _no_split_modules); use trainer.strategy=ddp"
        )
    return layers


def shard_trainer(core, size: int) -> None:
    """Shard a `PolicyTrainer`'s model (and frozen reference) over `size` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    require_collective_thread("sharding the model")
    device = next(core.model.parameters()).device.type
    mesh = init_device_mesh(device, (size,))
    core.runner = shard_module(core.model, mesh)
    reference = core.reference
    if reference is not None:
        if reference.scope is None:  # a frozen copy: sharded on its own
            reference.runner = shard_module(reference.model, mesh)
        else:  # the same model with the adapter off
            reference.runner = core.runner
    core.build_optimizer()  # over the sharded parameters


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (an all-gather: every rank must call it); others as is."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    require_collective_thread("gathering a sharded tensor")
    return tensor.full_tensor()


def like(template: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (whole) laid out as `template`: this rank's shard of a sharded template."""
    if not hasattr(template, "device_mesh"):
        return tensor
    from torch.distributed.tensor import distribute_tensor

    # every rank holds the whole tensor (read from the checkpoint): no communication
    return distribute_tensor(
        tensor.to(template.dtype),
        template.device_mesh,
        template.placements,
        src_data_rank=None,
    )
