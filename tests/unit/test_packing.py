"""Packed forwards (plain and shared-prefix) reproduce a padded HF forward, gradients included."""

import copy
import random

import pytest
import torch

from asyncgrpo.learning.trainer.packing import (
    embedded,
    enable_packed_attention,
    pack_sequences,
    packed_token_logprobs,
    pad_ragged,
    plan_micro_batches,
)
from asyncgrpo.learning.trainer.prompt_tree import MIN_SAVED_ROWS
from asyncgrpo.testing import build_tiny_llama

VOCAB = 300
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def models():
    reference = build_tiny_llama(VOCAB, num_layers=2, seed=3)  # stock sdpa
    packed = copy.deepcopy(reference)
    enable_packed_attention(packed)
    return reference, packed


def grpo_like_batch():
    """Two groups sharing prompts (one completion of a single token), and two loners."""
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    p1, p2 = rand(9), rand(4)
    seqs = [p1 + rand(6), p1 + rand(1), p1 + rand(11), rand(13), p2 + rand(3), p2 + rand(8)]
    seqs.append(rand(5))
    prompts = [9, 9, 9, 6, 4, 4, 2]
    return seqs, prompts


def prompt_tree_batch():
    """Prompts that share prefixes across groups, by hand: a 20-token system run shared by
    six prompts; prompt C extends prompt A; L3's prompt is the system run itself; group D's
    completions are single tokens; L2 shares nothing."""
    g = torch.Generator().manual_seed(5)

    def rand(n):
        return torch.randint(100, VOCAB, (n,), generator=g).tolist()

    system = list(range(10, 30))
    a, b, d = system + list(range(30, 36)), system + list(range(40, 44)), system + [70, 71]
    c, l1 = a + [50, 51, 52], system + list(range(60, 65))
    seqs = [a + rand(5), b + rand(3), c + rand(4), a + rand(1), l1 + rand(6), [80, 81, 82]]
    seqs += [rand(4), system + rand(5), b + rand(9), d + rand(1), a + rand(7), c + rand(2)]
    seqs += [d + rand(1)]
    seqs[5] = seqs[5] + seqs.pop(6)  # L2: a 3-token prompt and a 4-token completion
    prompts = [26, 24, 29, 26, 25, 3, 20, 24, 22, 26, 29, 22]
    return seqs, prompts


def padded_reference(model, seqs, prompts):
    """Ordinary HF forward: right padding, one sequence per row, full log-softmax."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # (B, T)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # (B, T)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, V)
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    logprobs, entropy = [], []
    for row, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        rows = logp[row, p - 1 : len(s) - 1]  # (C, V)
        logprobs.append(rows.gather(1, torch.tensor(s[p:])[:, None]).squeeze(1))
        entropy.append(-(rows.exp() * rows).sum(-1))
    return logprobs, entropy


def weighted_loss(logprobs, entropy):
    g = torch.Generator().manual_seed(1)
    total = 0.0
    for lp, ent in zip(logprobs, entropy, strict=True):
        total = total + (lp * torch.randn(len(lp), generator=g)).sum() + 0.1 * ent.sum()
    return total


def grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("batch", [grpo_like_batch, prompt_tree_batch])
@pytest.mark.parametrize(
    "share_prefix,attention", [(False, "segments"), (True, "segments"), (True, "mask")]
)
def test_packed_logprobs_entropy_and_gradients_match_padded_forward(
    models, batch, share_prefix, attention
):
    reference, packed = models
    seqs, prompts = batch()
    want_lp, want_ent = padded_reference(reference, seqs, prompts)
    weighted_loss(want_lp, want_ent).backward()
    want_grads = grads(reference)

    out = packed_token_logprobs(
        packed,
        seqs,
        prompt_lengths=prompts,
        temperature=TEMPERATURE,
        with_entropy=True,
        share_prefix=share_prefix,
        attention=attention,
    )
    assert [len(lp) for lp in out.logprobs] == [len(s) - p for s, p in zip(seqs, prompts)]
    for got, want in zip(out.logprobs + out.entropy, want_lp + want_ent, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weighted_loss(out.logprobs, out.entropy).backward()
    got_grads = grads(packed)
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        rel = (got_grads[name] - want).norm() / want.norm()
        assert rel < 1e-5, f"{name}: relative gradient error {rel:.2e}"


def test_a_tied_trained_embedding_is_looked_up_sparsely_and_its_gradient_ends_dense(models):
    _, packed = models
    forward = {"input_ids": torch.tensor([[5, 7, 5]]), "use_cache": False}
    looked_up = embedded(packed, forward)
    assert set(looked_up) == {"inputs_embeds", "use_cache"}
    torch.testing.assert_close(
        looked_up["inputs_embeds"], packed.model.embed_tokens(forward["input_ids"])
    )
    looked_up["inputs_embeds"].sum().backward()
    assert packed.lm_head.weight.grad.is_sparse  # alone, the lookup's gradient is the rows
    packed.zero_grad(set_to_none=True)

    seqs, prompts = grpo_like_batch()
    out = packed_token_logprobs(packed, seqs, prompts, with_entropy=True)
    weighted_loss(out.logprobs, out.entropy).backward()
    assert not any(p.grad.is_sparse for p in packed.parameters())  # added into the head's
    packed.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert embedded(packed, forward) is forward


def test_an_untied_or_frozen_embedding_keeps_the_ids():
    forward = {"input_ids": torch.tensor([[1, 2]])}
    untied = build_tiny_llama(VOCAB, num_layers=1, seed=0)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert embedded(untied, forward) is forward
    frozen = build_tiny_llama(VOCAB, num_layers=1, seed=0)
    frozen.requires_grad_(False)
    assert embedded(frozen, forward) is forward


def test_model_with_packed_attention_still_runs_ordinary_padded_forwards(models):
    reference, packed = models
    seqs, prompts = grpo_like_batch()
    with torch.no_grad():
        for got, want in zip(
            padded_reference(packed, seqs, prompts)[0],
            padded_reference(reference, seqs, prompts)[0],
            strict=True,
        ):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_segment_attention_requires_enabling(models):
    reference, _ = models
    with pytest.raises(RuntimeError, match="enable_packed_attention"):
        packed_token_logprobs(reference, [[1, 2, 3]], prompt_lengths=[1])


def test_shared_prefix_layout_stores_the_prompt_once_and_continues_positions():
    prompt = [5, 6, 7]
    seqs = [prompt + [1, 2, 3], prompt + [4], prompt + [8, 9], [10, 11, 12]]
    plain = pack_sequences(seqs, [3, 3, 3, 1], share_prefix=False)
    shared = pack_sequences(seqs, [3, 3, 3, 1], share_prefix=True)
    assert plain.input_ids.shape[1] == sum(len(s) - 1 for s in seqs)
    # prompt once, each completion without its last token, the loner without its last token
    assert shared.input_ids[0].tolist() == [5, 6, 7, 1, 2, 8, 10, 11]
    assert shared.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1]
    assert shared.counts == [3, 1, 2, 2]
    assert shared.targets.tolist() == [1, 2, 3, 4, 8, 9, 11, 12]
    # every completion's first token is predicted by the prompt's last row
    assert shared.rows.tolist() == [2, 3, 4, 2, 2, 5, 6, 7]
    mask = shared.block_mask()[0, 0]
    assert mask[5].tolist() == [True, True, True, False, False, True, False, False]
    assert not mask[6, :6].any() and mask[7, 6:].all()


def test_prompts_sharing_a_prefix_store_it_once_and_continue_its_positions():
    seqs, prompts = prompt_tree_batch()
    packed = pack_sequences(seqs, prompts)
    # the system run once (20), the rest of A (6), C behind A (3), B (4), D (2), L1's rest
    # with its completion (5 + 5), L2 alone (3 + 3), then completions without their last
    # token: A 4 + 0 + 6, B 2 + 8, C 3 + 1, L3 4, D 0 + 0 (185 rows unshared across groups)
    assert packed.input_ids.shape[1] == 20 + 6 + 3 + 4 + 2 + 10 + 6 + 10 + 10 + 4 + 4 == 79
    assert packed.input_ids[0, :20].tolist() == list(range(10, 30))
    ids = packed.input_ids[0].tolist()
    a_rest = next(seg for seg in packed.segments if ids[seg.start] == 30)
    assert ids[a_rest.start : a_rest.end] == list(range(30, 36)) and a_rest.prefix == 0
    assert packed.position_ids[0, a_rest.start : a_rest.end].tolist() == list(range(20, 26))
    # L3's prompt is the system run: its first token is predicted by the run's last row
    assert packed.rows[sum(packed.counts[:6])].item() == 19
    # C's rest attends to the system run and the rest of A, and to nothing else before it
    c_rest = next(seg for seg in packed.segments if ids[seg.start] == 50)
    assert packed.segments[c_rest.prefix] == a_rest
    mask = packed.block_mask()[0, 0]
    before = mask[c_rest.start, : c_rest.start]
    assert before.nonzero().flatten().tolist() == [*range(20), *range(a_rest.start, a_rest.end)]


def test_a_short_shared_run_stays_in_each_prompt():
    """Two prompts sharing 3 tokens save 3 rows: below MIN_SAVED_ROWS, so not split off."""
    seqs = [[1, 2, 3, 4, 5, 9, 9], [1, 2, 3, 6, 7, 8, 8], [1, 2, 3, 4, 5, 7, 7]]
    packed = pack_sequences(seqs, [5, 5, 5])
    assert MIN_SAVED_ROWS > 3
    assert [(s.start, s.end, s.prefix) for s in packed.segments] == [
        (0, 5, None),  # 1 2 3 4 5: the prompt of sequences 0 and 2
        (5, 6, 0),
        (6, 7, 0),
        (7, 13, None),  # sequence 1 alone: 1 2 3 6 7 | 8
    ]


def test_sequences_without_completion_tokens_get_empty_logprobs(models):
    _, packed = models
    out = packed_token_logprobs(packed, [[1, 2, 3], [1, 2, 3]], [3, 3], with_entropy=True)
    assert [len(x) for x in out.logprobs + out.entropy] == [0, 0, 0, 0]
    mixed = packed_token_logprobs(packed, [[1, 2, 3], [1, 2, 3, 4]], [3, 3])
    assert [len(x) for x in mixed.logprobs] == [0, 1]


def test_prompt_lengths_are_validated():
    with pytest.raises(ValueError, match="prompt_lengths\\[0\\]"):
        pack_sequences([[1, 2]], [0])
    with pytest.raises(ValueError, match="longer than its sequence"):
        pack_sequences([[1, 2]], [3])


def test_plan_micro_batches_respects_the_budget_and_covers_every_index_once():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 80))]
        budget = rng.choice([256, 512, 1000])
        plan = plan_micro_batches(lengths, budget)
        assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
        for batch in plan:
            assert len(batch) == 1 or sum(lengths[i] for i in batch) <= budget
        fitting = sum(length for length in lengths if length <= budget)
        oversized = sum(length > budget for length in lengths)
        assert len(plan) <= oversized + 11 / 9 * (fitting / budget) + 2  # FFD bound
        assert plan == plan_micro_batches(list(lengths), budget)  # deterministic


def test_plan_micro_batches_packs_tightly_and_isolates_long_sequences():
    assert plan_micro_batches([6, 4, 5, 5, 20], 10) == [[4], [0, 1], [2, 3]]
    assert plan_micro_batches([], 10) == []


def test_plan_micro_batches_keeps_groups_together_when_they_fit():
    lengths = [3, 3, 3, 4, 4, 4, 9, 9]
    groups = ["a", "a", "a", "b", "b", "b", "c", "c"]
    plan = plan_micro_batches(lengths, 12, groups)
    assert [0, 1, 2] in plan and [3, 4, 5] in plan  # groups a (9) and b (12) intact
    assert sorted(i for batch in plan for i in batch) == list(range(8))
    assert all(sum(lengths[i] for i in batch) <= 12 for batch in plan)


def test_pad_ragged_pads_right_and_keeps_gradients():
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    padded, mask = pad_ragged([a, [4.0], torch.zeros(0)])
    assert padded.tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert padded.dtype == mask.dtype == torch.float32
    (padded * mask).sum().backward()
    assert a.grad.tolist() == [1, 1, 1]
    empty, empty_mask = pad_ragged([])
    assert empty.shape == empty_mask.shape == (0, 0)


def test_packed_forward_under_bf16_autocast_stays_close_to_fp32(models):
    _, packed = models
    seqs, prompts = grpo_like_batch()
    with torch.no_grad():
        want = packed_token_logprobs(packed, seqs, prompt_lengths=prompts).logprobs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = packed_token_logprobs(packed, seqs, prompt_lengths=prompts).logprobs
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=0.15, rtol=0.05)


def test_auto_attention_is_segments_on_a_cpu_and_varlen_only_where_its_kernel_runs():
    from asyncgrpo.base.config import TrainerConfig

    on = TrainerConfig(bf16_autocast=True)
    off = TrainerConfig(bf16_autocast=False)
    assert on.attention_for("cpu", varlen_kernel=True) == "segments"
    assert on.attention_for("cuda", varlen_kernel=True) == "varlen"
    assert on.attention_for("cuda", varlen_kernel=False) == "mask"  # old torch: no kernel
    assert off.attention_for("cuda", varlen_kernel=True) == "mask"  # fp32 activations
    assert TrainerConfig(attention="mask").attention_for("cuda", varlen_kernel=True) == "mask"


def test_cpu_segment_attention_stays_float32_under_bf16_autocast():
    """CPU autocast would round sdpa's inputs to bf16 (and its backward ran ~3x slower);
    the segments must attend in float32: float32 error against a float64 reference."""
    from asyncgrpo.learning.trainer.packing import packed_attention_forward

    seqs, prompts = grpo_like_batch()
    packed = pack_sequences(seqs, prompts)
    n, heads, kv_heads, dim = packed.input_ids.shape[1], 4, 2, 16
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, n, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    allowed = packed.block_mask()[0, 0]  # (N, N)
    scores = q[0].double() @ k[0].double().repeat_interleave(2, 0).transpose(1, 2) / dim**0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # (H, N, N)
    want = (weights @ v[0].double().repeat_interleave(2, 0)).transpose(0, 1)  # (N, H, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = packed_attention_forward(None, q, k, v, None, packed_segments=packed.segments)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)


def test_merged_completions_attend_as_the_unmerged_ones():
    """Completions behind one prompt join into one call while they fit `max_rows`; each
    row still sees the whole prompt and only its own completion, causally."""
    from asyncgrpo.learning.trainer.segments import attend_segments, merge_completions

    seqs, prompts = grpo_like_batch()
    packed = pack_sequences(seqs, prompts)
    merged = merge_completions(packed.segments)

    def layout(segments):
        return [(s.start, s.end, s.prefix) for s in segments]

    # p1 + completions of 5 and 10 input rows, the loner of 12, p2 + completions of 2 and 7,
    # the loner of 4: each pair of completions becomes one segment
    assert layout(merged) == [
        (0, 9, None),
        (9, 24, 0),
        (24, 36, None),
        (36, 40, None),
        (40, 49, 3),
        (49, 53, None),
    ]
    first = merged[1].mask  # (15, 9 + 15): prompt, then two causal blocks of 5 and 10
    assert first[:, :9].all()
    assert first[4, 9:14].tolist() == [True] * 5 and not first[4, 14:].any()
    assert first[5, 9:14].sum() == 0 and first[5, 14].item() and not first[5, 15:].any()
    assert layout(merge_completions(packed.segments, max_rows=8)) == layout(packed.segments)

    n = packed.input_ids.shape[1]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g, requires_grad=True) for _ in range(3))
    want = attend_segments(q, k, v, packed.segments, 0.0, None)
    got = attend_segments(q, k, v, merged, 0.0, None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    upstream = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), upstream), want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_merging_leaves_alone_the_segments_other_segments_continue():
    """In a prompt tree a segment can be both behind a prefix and the prefix of others;
    merged, the tree's attention is unchanged."""
    from asyncgrpo.learning.trainer.segments import attend_segments, merge_completions

    seqs, prompts = prompt_tree_batch()
    packed = pack_sequences(seqs, prompts)
    merged = merge_completions(packed.segments)
    assert len(merged) < len(packed.segments)
    parents = {packed.segments[s.prefix] for s in packed.segments if s.prefix is not None}
    kept = {(s.start, s.end) for s in merged}
    assert all((p.start, p.end) in kept for p in parents)
    n = packed.input_ids.shape[1]
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g, requires_grad=True) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packed.block_mask())
    torch.testing.assert_close(attend_segments(q, k, v, merged, 0.0, None), want)
    torch.testing.assert_close(attend_segments(q, k, v, packed.segments, 0.0, None), want)
