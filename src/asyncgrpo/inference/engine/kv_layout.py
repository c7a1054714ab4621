"""The embedded engine's KV cache and prefix cache, as `engine.kv_cache` lays them out.

`slots` (the CPU's default): `ModelRunner`'s contiguous row per sequence and
`PrefixCache`'s copied blocks, the CPU's fastest. `paged` (cuda's, and the only one
there): `PagedModelRunner`'s block tables and `PagedPrefixCache`'s shared blocks, which
the CPU runs too (tested against `slots` for equal tokens and log-probs), attended as
`engine.paged_attention` says (`gather` on the CPU, FlexAttention on cuda). The runner
computes on the model's device, where the engine loaded it. The scheduler sees one
interface either way.
"""

from __future__ import annotations

import torch

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.prefill import STAGING_SLOTS
from asyncgrpo.inference.engine.prefix_cache import BLOCK, PrefixCache
from asyncgrpo.inference.engine.runner import ModelRunner


def build_cache(config: EmbeddedEngineConfig, model: torch.nn.Module, max_model_len: int):
    """(runner, prefix cache) for `config.kv_cache` on the model's device: decode slots
    plus the staging slots of long prompts."""
    slots = config.max_num_seqs + STAGING_SLOTS
    if config.resolved_kv_cache() == "slots":
        runner = ModelRunner(model, slots, max_model_len)
        return runner, PrefixCache(runner, config.prefix_cache_tokens)
    from asyncgrpo.inference.engine.paged.prefix import PagedPrefixCache
    from asyncgrpo.inference.engine.paged.runner import PagedModelRunner

    prefix_blocks = config.prefix_cache_tokens // BLOCK
    attention = config.resolved_paged_attention()
    runner = PagedModelRunner(model, slots, max_model_len, BLOCK, prefix_blocks, attention)
    return runner, PagedPrefixCache(runner, config.prefix_cache_tokens)
