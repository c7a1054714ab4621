"""The paged KV pools: one key and one value tensor per layer, sized from a memory budget.

Layout: `keys[layer]` is `(kv_heads, num_blocks * block_size, head_dim)`, the blocks
end to end along the position axis, so `pool(layer)` is the `(1, kv_heads, slots,
head_dim)` view FlexAttention takes as one long key sequence of batch one (attention.py
broadcasts it over the batch and selects each row's blocks with a block mask). This is
head-major, as torch's own paged-attention example lays its cache; vLLM and nano-vllm
keep `(num_blocks, block_size, kv_heads, head_dim)` for flash-attention's paged
kernels. A step writes its new tokens' keys and values with one `index_copy_` per pool
and layer along the slot axis (`slot_mapping`, tables.py); the padding rows of a
CUDA-graph batch write into the scratch block (block 0), which is zeroed here so that
what they read back is finite.

Every tensor is made on the `device` given; nothing here knows whether it is a GPU.
"""

from __future__ import annotations

import torch

from asyncgrpo.inference.engine.paged.blocks import SCRATCH_BLOCK
from asyncgrpo.inference.engine.runner import lazy_zeros


def bytes_per_block(
    layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> int:
    """Bytes of one block across all layers: keys and values of `block_size` positions."""
    element = torch.empty((), dtype=dtype).element_size()
    return layers * kv_heads * head_dim * 2 * element * block_size


def blocks_for_budget(
    budget_bytes: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
) -> int:
    """How many blocks (the scratch block included) fit in `budget_bytes`; at least two
    (the scratch block and one to use), else ValueError."""
    per_block = bytes_per_block(layers, kv_heads, head_dim, dtype, block_size)
    count = budget_bytes // per_block
    if count < 2:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {count} blocks of {per_block} "
            "bytes; it needs at least 2 (the scratch block and one to use)"
        )
    return int(count)


class PagedKVCache:
    """Key and value pools of every layer, in blocks of `block_size` positions."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        zeroed: bool = False,
    ):
        self.layers = layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.slots = num_blocks * block_size
        shape = (layers, kv_heads, self.slots, head_dim)
        self.keys = _pool(shape, dtype, device, zeroed)  # (L, Hkv, slots, D)
        self.values = _pool(shape, dtype, device, zeroed)  # (L, Hkv, slots, D)
        scratch = slice(SCRATCH_BLOCK * block_size, (SCRATCH_BLOCK + 1) * block_size)
        self.keys[:, :, scratch].zero_()
        self.values[:, :, scratch].zero_()

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """As many blocks as `budget_bytes` holds."""
        count = blocks_for_budget(budget_bytes, layers, kv_heads, head_dim, dtype, block_size)
        return cls(layers, kv_heads, head_dim, count, block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(1, kv_heads, slots, head_dim)` views of one layer's key and value pools."""
        return self.keys[layer].unsqueeze(0), self.values[layer].unsqueeze(0)

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store a step's new keys and values, `(N, kv_heads, head_dim)` each, at the pool
        slots `slot_mapping` `(N,)` int64 (tables.py; padding rows: the scratch block)."""
        self.keys[layer].index_copy_(1, slot_mapping, keys.transpose(0, 1))
        self.values[layer].index_copy_(1, slot_mapping, values.transpose(0, 1))

    def copy_blocks(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy whole blocks `sources` `(M,)` to `targets` `(M,)` in every layer (the
        partial block a forked sequence gets, `BlockTables.fork`)."""
        offsets = torch.arange(self.block_size, device=sources.device)
        source_slots = (sources.unsqueeze(1) * self.block_size + offsets).flatten()  # (M*bs,)
        target_slots = (targets.unsqueeze(1) * self.block_size + offsets).flatten()  # (M*bs,)
        for pool in (self.keys, self.values):
            pool.index_copy_(2, target_slots, pool.index_select(2, source_slots))


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device, zeroed: bool) -> torch.Tensor:
    """A pool's storage. `zeroed`: every position reads as zero until written (an engine
    that gathers whole blocks multiplies unwritten positions by a zero weight, which
    uninitialised memory could turn into NaN); on a CPU as zero pages mapped on first
    touch, so untouched blocks cost no memory."""
    if not zeroed:
        return torch.empty(shape, dtype=dtype, device=device)
    if torch.device(device).type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
