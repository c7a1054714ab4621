"""The embedded engine's forward pass: Llama-family decoder layers over a slot KV cache.

Why not call the transformers model directly? One `transformers` forward with its
dynamic cache costs several times the arithmetic of its linear layers at decode
time (cache bookkeeping, per-step mask building, per-op dispatch). This runner
reads the *same* `transformers` model object the trainer uses — its parameters,
rotary tables and norms — and runs a lean forward over a preallocated cache:

- q/k/v and gate/up projections are fused into one matmul each. The fused tensor
  owns the storage and the model's own `q_proj.weight` etc. become views into it,
  so a weight update that copies into the model's parameters updates the fused
  weights too, with no extra memory and nothing to re-fuse.
- The cache is indexed by slot: `k_cache[layer]` is `(slots, kv_heads, capacity, head_dim)`.
  Decoding sequences always occupy slots `0..B-1` (the engine keeps them compact),
  so attention reads a view of the cache instead of gathering it.
- Grouped-query heads are folded into the query length for decode, so attention is
  one small batched matmul per layer without repeating keys and values.
- The capacity (length dimension) grows on demand, so a short workload with many
  sequences does not pay for the full context length in memory.
- Matmuls use weights prepacked by oneDNN into its blocked layout where PyTorch
  has oneDNN (measured at batch 32, one thread: LM head 53 -> 33 ms, MLP 15%
  faster). The packed copies are rebuilt lazily after a weight update.

Architectures: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norms). Others are
refused with a clear error rather than run subtly wrong.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch
import torch.nn.functional as F

from asyncgrpo.inference.engine.attention import (
    decode_attention,
    decode_spans,
    prefill_attention,
    prefill_pieces,
)
from asyncgrpo.inference.engine.forward_steps import DecodeStep, PackedChunks, PrefillStep
from asyncgrpo.inference.engine.types import RequestError

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}


def _fuse_rows(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linear layers along their output rows; make each layer a view into the result."""
    weight = torch.cat([lin.weight.data for lin in linears], dim=0).contiguous()
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):
        parts = [
            lin.bias.data if lin.bias is not None else torch.zeros_like(lin.weight.data[:, 0])
            for lin in linears
        ]
        bias = torch.cat(parts).contiguous()
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[offset : offset + rows]
        if bias is not None and lin.bias is not None:
            lin.bias.data = bias[offset : offset + rows]
        offset += rows
    return weight, bias


PACK_BATCH_HINT = 32  # the batch size oneDNN tunes the packed layout for (any size works)
# oneDNN and BLAS take a matrix-vector kernel for one or two rows, which rounds otherwise
# (~1e-6 on SmolLM2-135M's MLP): fewer rows are padded to this many (4 and up agree)
MIN_LINEAR_ROWS = 4


class _Linear:
    """y = x W^T + b with W prepacked by oneDNN when possible, plain F.linear otherwise.

    `weight` stays the model's own storage (updates are copied into it); call
    `pack()` after it changes.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_onednn: bool):
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        self.use_onednn = use_onednn
        self.pack()

    def pack(self) -> None:
        if self.use_onednn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows >= MIN_LINEAR_ROWS:
            return self._apply(x)
        # a row's result must not depend on how many rows share the call (attention.py)
        padded = x.new_zeros(MIN_LINEAR_ROWS, x.shape[-1])
        padded[:rows] = x.reshape(rows, -1)
        return self._apply(padded)[:rows].view(*x.shape[:-1], -1)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can run packed linears of this dtype on this CPU (fp32: any x86/ARM)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.zeros(8, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


class _Layer:
    """One decoder layer's (fused) linear layers and norms."""

    def __init__(self, layer: torch.nn.Module, use_onednn: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Linear(*_fuse_rows(attn.q_proj, attn.k_proj, attn.v_proj), use_onednn)
        self.o = _Linear(attn.o_proj.weight, attn.o_proj.bias, use_onednn)
        self.gate_up = _Linear(_fuse_rows(mlp.gate_proj, mlp.up_proj)[0], None, use_onednn)
        self.down = _Linear(mlp.down_proj.weight, None, use_onednn)
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from an anonymous memory map: the OS maps zero pages on first touch, so a
    large cache costs neither start-up time nor memory until sequences reach it
    (`torch.zeros` writes every byte: 1.3 s for the 0.75 GB fp32 cache of 64 slots x 256
    positions of SmolLM2-135M on one machine, 0.24 s on another).

    Not `np.zeros`: numpy asks for transparent huge pages on large arrays, and on a 2-core
    EPYC VM touching 766 MB of them took 1.4-1.6 s against 0.24-0.36 s in 4 KB pages: the
    first requests through fresh slots paid ~1 s of it (prefix-cache loads 31 ms a request
    against 1.4 ms once touched)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    return torch.from_numpy(pages).view(dtype).view(shape)


class ModelRunner:
    """Runs prefill and decode forwards of a causal LM against a slot-indexed KV cache."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_model_len: int):
        config = model.config
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise RequestError(
                f"the embedded engine does not run model_type '{config.model_type}' "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}); use "
                "`engine.type: vllm`",
                status=500,
            )
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.group = self.num_heads // self.num_kv_heads
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm
        self.device = self.embed.device  # the model's: a CUDA model runs on its GPU
        use_onednn = self.device.type == "cpu" and onednn_linear_available(self.dtype)
        self.lm_head = _Linear(model.lm_head.weight, None, use_onednn)
        self.layers = [_Layer(layer, use_onednn) for layer in inner.layers]
        self._stale: list[_Linear] = []
        positions = torch.arange(max_model_len, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(probe, positions)
        self.cos = cos[0].to(self.dtype)  # (L, D)
        self.sin = sin[0].to(self.dtype)  # (L, D)
        self.capacity = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.ensure_capacity(min(256, max_model_len))

    def _linears(self) -> list[_Linear]:
        fused = [
            lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        return fused + [self.lm_head]

    def untie_head(self, weight: torch.Tensor) -> None:
        """The LM head reads `weight` from now on, no longer the input embedding's storage."""
        self.lm_head = _Linear(weight, None, self.lm_head.use_onednn)

    def weights_changed(self, tensors: list[torch.Tensor] | None = None) -> None:
        """The model's weights were updated in place: repack before the next forward.

        `tensors`: the updated parameters (None: all). Only the packed linears over their
        storage are repacked (a q/k/v/o adapter sync skips the MLPs and the LM head: 17
        instead of 85 ms on SmolLM2-135M); a fused layer's parts share its storage, and a
        tied embedding the head's.
        """
        if tensors is None:
            self._stale = self._linears()
            return
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        self._stale += [
            lin for lin in self._linears() if lin.weight.untyped_storage().data_ptr() in storages
        ]

    def _refresh(self) -> None:
        stale, self._stale = self._stale, []
        for linear in {id(lin): lin for lin in stale}.values():
            linear.pack()

    # ---- cache management -------------------------------------------------

    def ensure_capacity(self, length: int) -> None:
        """Grow the cache's length dimension (to a power of two) so `length` positions fit."""
        if length <= self.capacity:
            return
        new_cap = min(self.max_model_len, max(256, 1 << (length - 1).bit_length()))
        shape = (self.num_slots, self.num_kv_heads, new_cap, self.head_dim)
        new_k, new_v = [], []
        for i in range(len(self.layers)):
            k = lazy_zeros(shape, self.dtype)
            v = lazy_zeros(shape, self.dtype)
            if self.capacity:
                k[:, :, : self.capacity] = self.k_cache[i]
                v[:, :, : self.capacity] = self.v_cache[i]
            new_k.append(k)
            new_v.append(v)
        self.k_cache, self.v_cache, self.capacity = new_k, new_v, new_cap

    def release_memory(self, keep: int = 256) -> None:
        """Shrink the cache back to a small capacity (call only when no sequence is live)."""
        self.capacity = 0
        self.k_cache, self.v_cache = [], []
        self.ensure_capacity(min(keep, self.max_model_len))

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst`."""
        if src == dst or length == 0:
            return
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def swap_slots(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` cached positions of slots `a` and `b`."""
        if a == b or length == 0:
            return
        pair, swapped = torch.tensor([a, b]), torch.tensor([b, a])
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[pair, :, :length] = k[swapped, :, :length]  # the right side is a copy
            v[pair, :, :length] = v[swapped, :, :length]

    # ---- forwards ------------------------------------------------------------

    def _attention_input(self, layer: _Layer, h: torch.Tensor, cos, sin):
        """Norm, fused qkv projection, optional q/k norms and rotary embedding.

        h: (N, T, hidden) -> q (N, heads, T, D), k/v (N, kv_heads, T, D)
        """
        n, t, _ = h.shape
        x = _rms_norm(h, layer.input_norm)
        qkv = layer.qkv(x)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, t, self.num_heads, self.head_dim)
        k = k.view(n, t, self.num_kv_heads, self.head_dim)
        v = v.view(n, t, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q = _rms_norm(q, layer.q_norm)
            k = _rms_norm(k, layer.k_norm)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (N, T, 1, D)
        q = _rotate(q, cos, sin).transpose(1, 2)
        k = _rotate(k, cos, sin).transpose(1, 2)
        return q, k, v.transpose(1, 2)

    def _mlp_residual(self, layer: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + layer.o(attn)
        x = _rms_norm(h, layer.post_norm)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return h + layer.down(F.silu(gate) * up)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits (..., V) of final hidden states (..., hidden)."""
        return self.lm_head(_rms_norm(h, self.final_norm)).float()

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step for the sequences in slots 0..B-1.

        tokens, positions: (B,) long — the newest token of each sequence and its position.
        Returns float32 logits (B, V) for the next token.
        """
        self._refresh()
        step = self._decode_step(tokens, positions)
        return self._decode_forward(tokens.to(self.device), positions.to(self.device), step)

    def _decode_forward(self, tokens: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        """The layers of a decode step, tokens and positions (B,) on the model's device;
        nothing here reads the host (a paged runner captures it as a CUDA graph)."""
        b = tokens.shape[0]
        h = F.embedding(tokens, self.embed).unsqueeze(1)  # (B, 1, hidden)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            q, k, v = self._attention_input(layer, h, cos, sin)
            # Fold the query heads that share a kv head into the query length.
            q = q.reshape(b, self.num_kv_heads, self.group, self.head_dim)
            attn = self._decode_attend(i, q, k, v, step)  # (B, kv_heads, group, D)
            h = self._mlp_residual(layer, h, attn.reshape(b, 1, -1))
        return self.logits(h[:, 0])

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> DecodeStep:
        """What every layer of a decode step reads: rows grouped by key length."""
        spans = decode_spans(positions, self.max_model_len)  # rows grouped by key length
        self.ensure_capacity(max(s.key_len for s in spans))
        return DecodeStep(torch.arange(tokens.shape[0]), positions, positions + 1, spans)

    def _decode_attend(self, i: int, q, k, v, step: DecodeStep) -> torch.Tensor:
        """Write one layer's new keys and values (B, kv_heads, 1, D) into the slots, then
        attend: q (B, kv_heads, group, D) -> (B, kv_heads, group, D)."""
        k_cache, v_cache = self.k_cache[i], self.v_cache[i]
        k_cache[step.rows, :, step.positions] = k[:, :, 0]
        v_cache[step.rows, :, step.positions] = v[:, :, 0]
        return decode_attention(q, k_cache, v_cache, step.spans, step.lengths)

    def prefill(self, slots: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run prompt chunks for several sequences at once, writing their keys and values.

        Row r feeds `chunks[r]` at positions `starts[r]..` into slot `slots[r]`, attending to
        that slot's cached positions before `starts[r]`. Returns float32 logits (R, V) of each
        chunk's last token.
        """
        return self.prefill_states(slots, chunks, starts)[0]

    @torch.inference_mode()
    def prefill_states(
        self, slots: list[int], chunks: list[list[int]], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill`, plus the final hidden states (R, T, hidden) of every position, T the
        longest chunk (a row's positions past its own chunk are padding): `logits(hidden)`
        gives any position's logits (prompt log-probs, prompt_logprobs.py).

        The linear layers run on the chunks' tokens packed end to end, not padded to the
        longest chunk (a step's rows start after prefix-cache hits of different lengths:
        half of a padded batch was padding); only attention lays queries out by row."""
        self._refresh()
        packed = PackedChunks.of(slots, chunks, starts)
        rows, cols = packed.rows, packed.cols
        tokens = torch.tensor([token for chunk in chunks for token in chunk], device=self.device)
        positions = (torch.tensor(starts)[rows] + cols).unsqueeze(0).to(self.device)  # (1, N)
        step = self._prefill_step(packed, chunks)
        h = F.embedding(tokens, self.embed).unsqueeze(0)  # (1, N, hidden)
        cos, sin = self.cos[positions], self.sin[positions]
        for i, layer in enumerate(self.layers):
            q, k, v = self._attention_input(layer, h, cos, sin)  # (1, heads, N, D)
            attn = self._prefill_attend(i, q, k, v, step)  # (N, heads, D)
            h = self._mlp_residual(layer, h, attn.reshape(1, len(rows), -1))
        hidden = h.new_zeros(len(chunks), packed.width, h.shape[-1])
        hidden[rows.to(self.device), cols.to(self.device)] = h[0]
        last = torch.tensor(packed.offsets[1:], device=self.device) - 1
        return self.logits(h[0, last]), hidden

    def _prefill_step(self, packed: PackedChunks, chunks) -> PrefillStep:
        """What every layer of a prefill reads: the chunks and their attention pieces."""
        self.ensure_capacity(max(packed.ends))
        return PrefillStep(packed, prefill_pieces(packed.slots, packed.starts, packed.ends))

    def _prefill_attend(self, i: int, q, k, v, step: PrefillStep) -> torch.Tensor:
        """Write one layer's packed new keys and values (1, kv_heads, N, D) into the rows'
        slots, then attend: q (1, heads, N, D) -> (N, heads, D)."""
        k_cache, v_cache = self.k_cache[i], self.v_cache[i]
        packed, offsets = step.packed, step.packed.offsets
        for r, (slot, start, end) in enumerate(zip(packed.slots, packed.starts, packed.ends)):
            k_cache[slot, :, start:end] = k[0, :, offsets[r] : offsets[r + 1]]
            v_cache[slot, :, start:end] = v[0, :, offsets[r] : offsets[r + 1]]
        by_row = packed.by_row(q[0].transpose(0, 1))  # (R, heads, T, D)
        attn = prefill_attention(by_row, k_cache, v_cache, step.pieces)
        return attn[packed.rows, :, packed.cols]
