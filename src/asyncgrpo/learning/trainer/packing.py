"""Padding-free training forward: many sequences in one row, prompts shared per group.

GRPO trains on G completions of each prompt, with lengths that vary tenfold.
Right-padding them into a (B, T) batch spends most of the compute on padding;
here every micro-batch is one packed row of real tokens:

- position ids restart at 0 for every sequence, and attention never crosses a
  sequence boundary (block-diagonal causal);
- shared prefix (default): consecutive or not, sequences with identical prompt
  ids are laid out as the prompt ONCE followed by each completion; a completion
  attends to the shared prompt plus its own earlier tokens, and its positions
  continue from the prompt length. G·(P+C) tokens become P+G·C; by causality the
  log-probs and gradients are those of the unshared sequences. Prompts that begin
  alike (a system prompt) share that beginning as well (`prompt_tree.py`);
- the last token of every sequence is never an input (it predicts nothing), and
  the LM head runs only on rows that predict a completion token.

Attention path. transformers 5 (`masking_utils._preprocess_mask_arguments`)
passes a 4D `attention_mask` through untouched, so sdpa with a dense (N, N)
block mask is correct — but it computes all N² scores of the packed row. The
default instead registers an `AttentionInterface` function that receives the
segment layout as a forward kwarg and calls sdpa once per segment (`is_causal`
for a plain sequence; a small (C, P+C) mask for a completion behind a shared
prompt), so the work is Σ Lᵢ² rather than N². The CPU has no flash-attn varlen
kernel; this is its equivalent. `benchmarks/train_step_packing.py` measures both.
`trainer.attention` chooses: the segments on a CPU; on a GPU, where one kernel per layer
beats many small ones, flash attention's variable-length kernel (`varlen.py`) under
autocast, else the dense mask (`docs/benchmarks/profiles.md`).
Without the packing kwarg the function is plain sdpa, so the model keeps
working for ordinary padded forwards. The per-segment calls are in `segments.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncgrpo.learning.trainer.logprobs import DEFAULT_CHUNK_ROWS, lm_head_token_logprobs
from asyncgrpo.learning.trainer.prompt_tree import lay_out, prompt_tree
from asyncgrpo.learning.trainer.segments import (
    Segment,
    ancestry,
    attend_segments,
    merge_completions,
    prefix_causal_mask,
    sdpa_kernels,
)
from asyncgrpo.learning.trainer.varlen import (
    VarlenLayout,
    varlen_attention,
    varlen_available,
    varlen_dtype,
    varlen_layout,
)

ATTN_IMPLEMENTATION = "asyncgrpo_packed"


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    segments: tuple[Segment, ...]  # contiguous, in order, covering [0, N)
    rows: torch.Tensor  # (M,) packed rows whose hidden state predicts a completion token
    targets: torch.Tensor  # (M,) the completion token each row predicts
    counts: list[int]  # completion tokens per input sequence (sum = M)

    def block_mask(self) -> torch.Tensor:
        """The equivalent dense boolean mask (1, 1, N, N); True = may attend."""
        n, device = self.input_ids.shape[1], self.input_ids.device
        mask = torch.zeros(n, n, dtype=torch.bool, device=device)
        for seg, chain in zip(self.segments, ancestry(self.segments), strict=True):
            length = seg.end - seg.start
            mask[seg.start : seg.end, seg.start : seg.end] = torch.ones(
                length, length, dtype=torch.bool, device=device
            ).tril()
            for a in chain:
                ancestor = self.segments[a]
                mask[seg.start : seg.end, ancestor.start : ancestor.end] = True
        return mask[None, None]


@dataclass
class PackedLogProbs:
    logprobs: list[torch.Tensor]  # per sequence, (C_i,) fp32, log-prob of each completion token
    entropy: list[torch.Tensor] | None  # per sequence, (C_i,) fp32


def _prompt_groups(
    seqs: Sequence[Sequence[int]], prompt_lengths: Sequence[int], share_prefix: bool
) -> list[list[int]]:
    """Indices grouped by identical prompt ids, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, (seq, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        if p < 1:
            raise ValueError(f"prompt_lengths[{i}] is {p}: a completion needs a prompt token")
        if p > len(seq):
            raise ValueError(f"prompt_lengths[{i}] is {p}, longer than its sequence ({len(seq)})")
        key = tuple(seq[:p]) if share_prefix else i
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def pack_sequences(
    seqs: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    share_prefix: bool = True,
    device: torch.device | str = "cpu",
    segment_masks: bool = True,
    targets: Sequence[Sequence[int] | None] | None = None,
) -> PackedBatch:
    """Lay sequences out in one row (see the module docstring), its tensors on `device`;
    nothing is padded. `segment_masks`: build each shared-prompt segment's own mask (the
    per-segment attention needs them; the dense `block_mask` does not). `targets`: see
    `packed_targets`."""
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    rows: list[list[int]] = [[] for _ in seqs]

    def append(tokens, first_position, prefix: int | None = None) -> tuple[int, int]:
        start = len(ids)
        ids.extend(tokens)
        positions.extend(range(first_position, first_position + len(tokens)))
        mask = None
        if prefix is not None and segment_masks:
            mask = prefix_causal_mask(len(tokens), first_position, device)
        segments.append(Segment(start, len(ids), prefix, mask))
        return len(segments) - 1, start

    groups = _prompt_groups(seqs, prompt_lengths, share_prefix)
    prompts = [seqs[group[0]][: prompt_lengths[group[0]]] for group in groups]
    if share_prefix:
        lay_out(prompt_tree(prompts, groups), seqs, append, rows)
    else:  # each sequence alone: its own tree
        for prompt, group in zip(prompts, groups, strict=True):
            lay_out(prompt_tree([prompt], [group]), seqs, append, rows)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        segments=tuple(segments),
        rows=torch.tensor(
            [r for seq_rows in rows for r in seq_rows], dtype=torch.long, device=device
        ),
        targets=torch.tensor(
            packed_targets(seqs, prompt_lengths, targets), dtype=torch.long, device=device
        ),
        counts=[len(r) for r in rows],
    )


def packed_targets(
    seqs: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    targets: Sequence[Sequence[int] | None] | None = None,
) -> list[int]:
    """The token each completion position predicts, all sequences in order.

    By default a sequence's own next tokens `seq[p:]`. `targets[i]`, when given and not
    None, replaces them (one per completion position, `len(seq) - p`): the rows and the
    prompt sharing stay those of the sequence, only the predicted token changes, so
    `seq[-1]` is then never read. Tinker's datums predict arbitrary `target_tokens`.
    """
    if targets is not None and len(targets) != len(seqs):
        raise ValueError(f"targets has {len(targets)} entries for {len(seqs)} sequences")
    out: list[int] = []
    for i, (seq, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        chosen = None if targets is None else targets[i]
        if chosen is None:
            out.extend(seq[p:])
            continue
        if len(chosen) != len(seq) - p:
            raise ValueError(
                f"targets[{i}] has {len(chosen)} tokens for {len(seq) - p} completion positions"
            )
        out.extend(chosen)
    return out


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, Hq, N, D)
    key: torch.Tensor,  # (1, Hkv, N, D)
    value: torch.Tensor,  # (1, Hkv, N, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: tuple[Segment, ...] | None = None,
    packed_varlen: VarlenLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One varlen flash call over the packed row (`varlen.py`) where its layout is given
    and the activations are half precision, else sdpa once per packed segment; plain
    transformers sdpa when not packing."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_segments is None:
        with sdpa_kernels(query.device):
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
    if query.shape[0] != 1:
        raise ValueError("a packed forward takes a single row")
    with sdpa_kernels(query.device):
        half = varlen_dtype(query) if packed_varlen is not None else None
        if half is not None and dropout == 0.0:
            query, key, value = (t.to(half) for t in (query, key, value))
            return varlen_attention(query, key, value, packed_varlen, scaling).contiguous(), None
        out = attend_segments(query, key, value, packed_segments, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _opaque_attention():
    return torch.compiler.disable(packed_attention_forward)  # imports torch._dynamo: lazily


def enable_packed_attention(model) -> None:
    """Register the packed attention function and select it on this HF model. The function
    is opaque to `torch.compile` (`compiled_layers.py`): its per-segment loop would unroll
    into a compiled layer's graph and recompile for every batch's segments."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _opaque_attention())
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def packed_token_logprobs(
    model,
    seqs: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prefix: bool = True,
    attention: str = "segments",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    top_p: float = 1.0,
    runner=None,
    targets: Sequence[Sequence[int] | None] | None = None,
) -> PackedLogProbs:
    """Per-sequence log-probs (and entropies) of the completion tokens, one packed forward.

    `runner`: what runs `run_packed`'s work (a sharded model's root module, `sharded.py`);
    default: `run_packed` on `model`. `targets`: tokens to score in place of a sequence's
    own next tokens (`packed_targets`); None scores the sequence itself.

    `attention="segments"` (and `"varlen"`, which is `"segments"` where the varlen kernel
    cannot run: no GPU, or fp32 activations) needs `enable_packed_attention(model)`;
    `"mask"` passes the dense block mask and works with any 4D-mask implementation.
    `top_p < 1`: under the sampler's nucleus, see `trainer/logprobs.py`.
    """
    device = next(model.parameters()).device
    per_segment = attention in ("segments", "varlen")
    packed = pack_sequences(seqs, prompt_lengths, share_prefix, device, per_segment, targets)
    if packed.rows.numel() == 0:  # no completion tokens: nothing to forward
        empty = [torch.zeros(0, device=device) for _ in seqs]
        return PackedLogProbs(logprobs=empty, entropy=list(empty) if with_entropy else None)
    forward = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    if per_segment:
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError("call enable_packed_attention(model) before a packed forward")
        # An all-ones 2D mask makes transformers skip mask building (sdpa is_causal path).
        forward.update(
            attention_mask=torch.ones_like(packed.input_ids),
            packed_segments=merge_completions(packed.segments),
        )
        if attention == "varlen" and device.type == "cuda" and varlen_available():
            forward.update(packed_varlen=varlen_layout(packed.segments, device))
    elif attention == "mask":
        forward.update(attention_mask=packed.block_mask())
    else:
        raise ValueError(f"attention must be 'segments', 'varlen' or 'mask', not {attention!r}")
    run = runner if runner is not None else functools.partial(run_packed, model)
    logprobs, entropy = run(
        forward, packed.rows, packed.targets, temperature, with_entropy, chunk_rows, top_p
    )
    return PackedLogProbs(
        logprobs=list(logprobs.split(packed.counts)),
        entropy=list(entropy.split(packed.counts)) if with_entropy else None,
    )


def run_packed(model, forward, rows, targets, temperature, with_entropy, chunk_rows, top_p):
    """The packed forward proper: the base model over the packed ids, then the chunked LM
    head at the completion rows only; (log-probs (M,), entropies (M,) or None)."""
    if hasattr(model, "get_base_model"):  # peft: the HF model it wraps (adapters inside)
        model = model.get_base_model()
    base = getattr(model, model.base_model_prefix)
    hidden = base(**embedded(model, forward)).last_hidden_state[0]  # (N, H)
    return lm_head_token_logprobs(
        hidden[rows],  # (M, H)
        model.get_output_embeddings(),
        targets,
        temperature,
        with_entropy,
        chunk_rows,
        top_p,
    )


def embedded(model, forward: dict) -> dict:
    """`forward` with the input embeddings looked up here, with a sparse gradient, when they
    are the trained, tied LM head's weight. Autograd then adds the packed ids' rows into
    the head's dense gradient, where the embedding's own backward would zero-fill a (V, H)
    float32 matrix and add it whole: 113 MB for SmolLM2-135M, 35 ms of a 2 s step on one
    CPU thread. Untied embeddings keep their dense gradient (the fused AdamW takes no
    sparse one)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    plain = type(embed) is torch.nn.Embedding and embed.max_norm is None  # no scaled subclass
    tied = head is not None and embed.weight is head.weight
    if not (plain and tied and embed.weight.requires_grad and torch.is_grad_enabled()):
        return forward
    ids = forward["input_ids"]
    embeds = F.embedding(ids, embed.weight, embed.padding_idx, sparse=True)
    return {**{k: v for k, v in forward.items() if k != "input_ids"}, "inputs_embeds": embeds}


def pad_ragged(
    values: Sequence[torch.Tensor | Sequence[float]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D rows to (B, T); returns (padded, mask) as float tensors (mask 1 = real),
    on the rows' device."""
    rows = [
        v if isinstance(v, torch.Tensor) else torch.tensor(list(v), dtype=torch.float32)
        for v in values
    ]
    rows = [r if r.is_floating_point() else r.float() for r in rows]
    width = max((len(r) for r in rows), default=0)
    if not rows:
        return torch.zeros(0, 0), torch.zeros(0, 0)
    padded = torch.stack([F.pad(r, (0, width - len(r))) for r in rows])  # (B, T)
    mask = torch.zeros(len(rows), width, dtype=padded.dtype, device=padded.device)  # (B, T)
    for i, r in enumerate(rows):
        mask[i, : len(r)] = 1.0
    return padded, mask


def plan_micro_batches(
    lengths: Sequence[int], token_budget: int, groups: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Split indices into micro-batches of at most `token_budget` tokens (first-fit decreasing).

    A sequence longer than the budget goes alone. With `groups` (e.g. a prompt
    id per sequence), members of a group stay together when the group fits the
    budget, so a packed forward can share their prompt; an oversized group is cut
    into consecutive runs that fit. Deterministic; indices ascending within a batch.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    units = _planning_units(lengths, token_budget, groups)
    order = sorted(range(len(units)), key=lambda u: (-units[u][0], units[u][1][0]))
    bins: list[list[int]] = []
    room: list[int] = []
    for u in order:
        cost, members = units[u]
        slot = next((b for b, free in enumerate(room) if cost <= free), None)
        if slot is None:
            bins.append([])
            room.append(token_budget)
            slot = len(bins) - 1
        bins[slot].extend(members)
        room[slot] -= cost
    return [sorted(b) for b in bins]


def _planning_units(lengths, token_budget, groups) -> list[tuple[int, list[int]]]:
    if groups is None:
        return [(length, [i]) for i, length in enumerate(lengths)]
    by_key: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        by_key.setdefault(key, []).append(i)
    units: list[tuple[int, list[int]]] = []
    for members in by_key.values():
        run: list[int] = []
        for i in members:
            if run and sum(lengths[j] for j in run) + lengths[i] > token_budget:
                units.append((sum(lengths[j] for j in run), run))
                run = []
            run.append(i)
        units.append((sum(lengths[j] for j in run), run))
    return units
