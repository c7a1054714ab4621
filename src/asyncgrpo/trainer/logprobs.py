"""Token log-probs and entropies of a causal LM, without a full (N, V) float32 copy.

The trainer needs log π(token) only for the sampled tokens, under the same
distribution the engine sampled from: `softmax(logits.float() / temperature)`.
A naive `log_softmax(logits).gather(...)` materialises the whole (N, V) matrix
in float32 twice (log-softmax output, kept for backward); at a 49k vocabulary
that is 200 kB per token. Here rows are processed in chunks through logsumexp.

`lm_head_token_logprobs` goes further and fuses the LM head into the same
chunk loop with a custom autograd Function: forward keeps only the hidden
states and one logsumexp (and one mean logit, for entropy) per row; backward
recomputes each chunk's logits. Peak memory of the head is then one chunk of
logits instead of all of them, for the price of one extra head matmul in the
backward pass (the Liger-kernel / "fused linear cross-entropy" idea, on CPU).
Callers apply it only to the rows that predict a completion token, so a long
prompt never pays for the vocabulary projection.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_ROWS = 512


def selective_log_softmax(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per row. logits (N, V), targets (N,) -> (N,) fp32.

    Differentiable; autograd keeps each chunk's float copy, so prefer
    `lm_head_token_logprobs` when the logits come from a linear head.
    """
    out = []
    for start in range(0, logits.shape[0], chunk_rows):
        z = logits[start : start + chunk_rows].float() / temperature  # (c, V)
        picked = z.gather(1, targets[start : start + chunk_rows, None]).squeeze(1)  # (c,)
        out.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row. logits (N, V) -> (N,) fp32."""
    out = []
    for start in range(0, logits.shape[0], chunk_rows):
        z = logits[start : start + chunk_rows].float() / temperature  # (c, V)
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (c, 1)
        out.append((lse - (torch.softmax(z, dim=-1) * z).sum(-1, keepdim=True)).squeeze(1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


def _chunk_logits(hidden, weight, bias, temperature) -> torch.Tensor:
    """Fresh (c, V) float32 logits / temperature, safe to modify in place."""
    logits = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())
    logits = logits.float()  # a copy only under bf16
    return logits.div_(temperature) if temperature != 1.0 else logits


class _LMHeadLogProbs(torch.autograd.Function):
    """Fused head + selective log-softmax (+ entropy); recomputes logits in backward.

    Works in place on each chunk: at most two (chunk, V) float32 buffers live.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, with_entropy):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)  # (M,)
        lse = hidden.new_empty(n, dtype=torch.float32)  # (M,)
        mean_z = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)  # (M,) E_p[z]
        for s in range(0, n, chunk_rows):
            rows = slice(s, s + chunk_rows)
            z = _chunk_logits(hidden[rows], weight, bias, temperature)  # (c, V)
            lse[rows] = torch.logsumexp(z, dim=-1)
            logprobs[rows] = z.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
            if with_entropy:
                log_p = z.sub_(lse[rows, None])  # (c, V), in place
                mean_z[rows] = (log_p.exp() * log_p).sum(-1) + lse[rows]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy = temperature, chunk_rows, with_entropy
        entropy = lse - mean_z if with_entropy else hidden.new_zeros(n, dtype=torch.float32)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, mean_z = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for s in range(0, hidden.shape[0], chunk_rows):
            rows = slice(s, s + chunk_rows)
            h = hidden[rows]  # (c, H)
            z = _chunk_logits(h, weight, bias, temperature)  # (c, V)
            p = torch.sub(z, lse[rows, None]).exp_()  # (c, V) softmax
            g_lp = grad_logprobs[rows, None]  # (c, 1)
            # d logp_t/dz = onehot(t) - p ;  d H/dz = -p (z - E_p[z])
            # => grad_z = onehot(t) g_lp - p (g_lp + g_ent (z - E_p[z]))
            if use_entropy:
                factor = z.sub_(mean_z[rows, None]).mul_(grad_entropy[rows, None]).add_(g_lp)
                grad_z = p.mul_(factor).neg_()
            else:
                del z
                grad_z = p.mul_(-g_lp)
            grad_z.scatter_add_(1, targets[rows, None], g_lp)
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_logits = grad_z.to(hidden.dtype)  # (c, V)
            if need_h:
                torch.mm(grad_logits, weight, out=grad_h[rows])
            if need_w and weight.dtype == torch.float32:
                grad_w.addmm_(grad_logits.t(), h)
            elif need_w:  # accumulate a low-precision head's gradient in float32
                grad_w += (grad_logits.t() @ h).float()
            if need_b:
                grad_b += grad_logits.float().sum(0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def lm_head_token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` (and entropies) under softmax(lm_head(hidden).float() / T).

    hidden (M, H) holds only the rows that predict a target; targets (M,).
    Returns fp32 tensors (M,), differentiable w.r.t. hidden and the head.
    Under CPU/CUDA autocast the head runs in the autocast dtype, as it would in
    an ordinary forward.
    """
    weight, bias = lm_head.weight, lm_head.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device_type, enabled=False):
        logprobs, entropy = _LMHeadLogProbs.apply(
            hidden, weight, bias, targets, float(temperature), chunk_rows, with_entropy
        )
    return logprobs, entropy if with_entropy else None
