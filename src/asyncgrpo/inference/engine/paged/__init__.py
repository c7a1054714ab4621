"""The device-independent parts of a CUDA engine: a paged KV cache, attention over it,
CUDA-graph batch buckets and the CUDA IPC weight handover.

The embedded engine's runner keeps one contiguous cache row per slot, which suits a
CPU. A GPU engine keeps keys and values in blocks, as vLLM and nano-vllm do: memory is
taken as sequences grow, a prompt prefix is shared between sequences instead of
copied, and decode runs as CUDA graphs. These modules are that engine's pieces; every
tensor is made on a `device` argument, and all of it runs and is tested on the CPU.

The pieces:
- `blocks.py`: `BlockAllocator`, the physical blocks: free list, reference counts,
  content keys of full blocks (hash of the tokens and the predecessor's key, checked
  on a hit), the scratch block 0, `OutOfBlocks` for a scheduler to preempt on.
- `tables.py`: `BlockTables`, each sequence's blocks: `admit` a prompt (sharing its
  cached prefix), `append` decode tokens across block boundaries, `fork` a sequence
  for another sample, `mark_written`, `free`; slot mappings, the padded `(B, W)`
  table, lengths, and each block's logical index.
- `cache.py`: `PagedKVCache`, the pools `(layers, kv_heads, slots, head_dim)` sized
  from a memory budget; `write` is one `index_copy_` per pool and layer.
- `attention.py`: decode attention (one token per row, GQA folded into the query
  length) and packed prefill attention over the pools with FlexAttention, the block
  table itself as the block mask; why not torch's experimental `PagedAttention`.
- `buckets.py`: CUDA-graph batch sizes, the bucket of a batch and its dummy rows.
- `handover.py`: the JSON message of a CUDA IPC weight handover, its checks against
  the engine's parameters, and the acknowledgement the trainer waits for.
- `runner.py`: `PagedModelRunner`, the engine's forward over the pools behind the slot
  runner's interface (a slot is a block table; copying one shares its full blocks;
  `decode_in_bucket` pads a decode to its graph bucket and runs the host-free layer
  body a CUDA graph will capture), and `prefix.py`: `PagedPrefixCache`, prefix hits shared in place. The engine runs
  on them with `engine.kv_cache: paged`; on a CPU they gather each step's keys into
  the slot runner's attention and sample exactly what the slot engine samples.

How the engine will use them on CUDA, per step (the CPU path of `runner.py` already
does the bookkeeping; what changes is attention and the graphs): the scheduler admits or appends
(preempting on `OutOfBlocks`), marks what the last step wrote, and builds the slot
mapping, tables and lengths; each layer writes the new keys and values into the pools
(`PagedKVCache.write`) and then attends: prefill with `prefill_attention` (compiled
with dynamic shapes, or a varlen flash kernel once no prefix hit is involved), decode
with `decode_attention` inside the captured graph of the batch's bucket, its metadata
copied into the graph's static buffers. Sampling stays on the device; the prefix cache
is the allocator's content keys (cleared with `forget_contents` on a weight update).

Tested on the CPU (tests/unit/test_paged_*.py, test_weight_handover.py): allocation,
sharing, eviction and all-or-nothing failure; slot mappings across block boundaries;
decode and prefill attention against dense causal attention over the same keys laid
out per sequence, in float64 (eager FlexAttention, exact to 1e-12) and float32
(compiled, which also checks the block mask); bucket choice and that dummy rows change
nothing real; the handover message's round trip and refusals.

What only a GPU can show (tests/unit/test_paged_cuda.py, marked `gpu`, checks the
first three): that Triton's flex kernels accept a block mask narrower than the pool
(`kernel_table_width`; else pad it to the pool as on a CPU) and the folded GQA heads;
blocks of 16 with a key tile of 16 (`kernel_options`) and of 128 (the default tile);
opening real IPC handles in another process. Then what no test here decides: the
fastest block size and tiles, full-block lists that skip the mask_mod, the speed
against flash-attention, and CUDA-graph capture and replay with these metadata
buffers.
"""
