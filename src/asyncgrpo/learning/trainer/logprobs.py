"""Token log-probs and entropies of a causal LM, without a full (N, V) float32 copy.

The trainer needs log π(token) only for the sampled tokens, under the same
distribution the engine sampled from: `softmax(logits.float() / temperature)`,
restricted to the engine's nucleus when `top_p < 1` (below).
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
prompt never pays for the vocabulary projection. On a CPU the passes over a large
chunk's logits run as one compiled kernel each way (`fused_head.py`).

Nucleus sampling (`top_p < 1`). The engine samples from the temperature-scaled
distribution truncated to its nucleus and renormalised, and reports that
distribution's log-probs (`processed_logprobs`). A full-vocabulary log-softmax
here would make every ratio π_θ/π_engine carry the kept mass as if it were a
policy change (TRL #6789/#6945), so with `top_p < 1` the trainer truncates its
own logits by the engine's rule (`engine/sampling.py`): sort descending, keep a
token while the probability mass before it is < top_p, the first always.
Choices, since the nucleus itself depends on the logits:

- the support S is the nucleus of the trainer's *own* logits, plus the sampled
  token (the engine's nucleus held it; under staleness or rounding it can sit
  just outside ours, and a −inf log-prob would poison the ratio). With the
  engine's weights and kernels S is exactly the engine's set;
- S is held fixed when differentiating: the gradient is that of log π_S, the
  renormalised policy on S (exact wherever S does not change, i.e. almost
  everywhere; the jumps where a token enters or leaves S have no gradient);
- tokens tied with the last kept logit are all kept (the engine's sort order
  among ties is arbitrary).

The cost is a top-k search of each chunk's logits in the forward (a full sort
for rows whose nucleus is wider than `NUCLEUS_FIRST_K` tokens); the backward
recomputes S from one threshold logit kept per row.
"""

from __future__ import annotations

import torch

from asyncgrpo.learning.trainer import fused_head

DEFAULT_CHUNK_ROWS = 512
HEAD_GRAD_BUFFER_BYTES = 256 << 20  # low-precision logit gradients held for one matmul
KEPT_LOGITS_BYTES = 512 << 20  # logits up to this size are kept: the backward skips the recompute


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


NUCLEUS_FIRST_K = 1024
"""Largest logits searched first for a row's nucleus; only wider nuclei sort the whole row
(at a 49k vocabulary, top-1024 costs 0.2-0.3 s per 512 rows on one thread, a sort 1.6 s)."""


def nucleus_threshold(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest logit of each row's top-p nucleus, by the engine's rule. z (c, V) -> (c,)."""
    threshold, found = _threshold_in_top(z, top_p, min(NUCLEUS_FIRST_K, z.shape[-1]))
    wide = ~found  # (c,)
    if wide.any():
        threshold[wide] = _threshold_in_top(z[wide], top_p, z.shape[-1])[0]
    return threshold


def _threshold_in_top(z: torch.Tensor, top_p: float, k: int):
    """(threshold (c,), found (c,) bool): the nucleus' smallest logit, found where the
    nucleus ends within the k largest logits."""
    if k < z.shape[-1]:
        top = torch.topk(z, k, dim=-1).values  # (c, k) descending
    else:  # a sort is ~3x faster than a top-k of everything
        top = torch.sort(z, dim=-1, descending=True).values  # (c, V)
    probs = top.sub(torch.logsumexp(z, dim=-1, keepdim=True)).exp_()  # (c, k)
    mass_before = probs.cumsum(dim=-1).sub_(probs)  # (c, k)
    kept = (mass_before < top_p).sum(dim=-1).clamp_(min=1)  # (c,) the first token always stays
    found = (kept < k) | (k == z.shape[-1])
    return top.gather(1, (kept - 1)[:, None]).squeeze(1), found


def outside_support(z: torch.Tensor, threshold: torch.Tensor, targets: torch.Tensor):
    """(c, V) bool: True for tokens below the row's nucleus threshold, except the target."""
    outside = z < threshold[:, None]  # (c, V)
    return outside.scatter_(1, targets[:, None], False)


def _product(hidden, weight, bias, out=None) -> torch.Tensor:
    """The head's (c, V) product in its own dtype, into `out` when given."""
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


def _float_logits(logits, temperature, copy: bool = False) -> torch.Tensor:
    """`logits` in float32 / temperature, as a new tensor where it is already float32 and
    `copy` says it must survive (kept logits: the caller works in place)."""
    logits = logits.clone() if copy and logits.dtype == torch.float32 else logits.float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class _LMHeadLogProbs(torch.autograd.Function):
    """Fused head + selective log-softmax (+ entropy). The backward needs the logits
    again: up to `KEPT_LOGITS_BYTES` they are kept from the forward (the same numbers; on
    a CPU the recompute is ~6% of a training step, a float32 copy of them ~0.5%), larger
    ones are recomputed chunk by chunk.

    Works in place on each chunk: at most two (chunk, V) float32 buffers live (more
    while a chunk's nucleus is found, with top_p < 1). Tokens outside the support
    get probability 0 (their logits stay finite, so no 0 · inf appears).
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        top_p,
        chunk_rows,
        with_entropy,
        dtype,
        keep_logits,
    ):
        n = hidden.shape[0]
        # the head multiplies in `dtype` (autocast's); its gradients go back in the
        # parameters' own dtype, accumulated in float32 and never rounded to `dtype`
        ctx.param_dtypes = weight.dtype, None if bias is None else bias.dtype
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        logprobs = hidden.new_empty(n, dtype=torch.float32)  # (M,)
        lse = hidden.new_empty(n, dtype=torch.float32)  # (M,) over the support
        mean_z = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)  # (M,) E_p[z]
        threshold = hidden.new_empty(n if top_p < 1 else 0, dtype=torch.float32)  # (M,)
        kept = None  # the head's product in `dtype`, for the backward
        if keep_logits and n * weight.shape[0] * weight.element_size() <= KEPT_LOGITS_BYTES:
            kept = hidden.new_empty(n, weight.shape[0], dtype=dtype)  # (M, V)
        for s in range(0, n, chunk_rows):
            rows = slice(s, s + chunk_rows)
            out = None if kept is None else kept[rows]
            product = _product(hidden[rows], weight, bias, out)  # (c, V) in `dtype`
            stats = _chunk_stats(
                product, out is not None, targets[rows], temperature, top_p, with_entropy
            )
            logprobs[rows], lse[rows], mean, bound = stats
            if with_entropy:
                mean_z[rows] = mean
            if top_p < 1:
                threshold[rows] = bound
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z, threshold, kept)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy = temperature, chunk_rows, with_entropy
        entropy = lse - mean_z if with_entropy else hidden.new_zeros(n, dtype=torch.float32)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, mean_z, threshold, kept = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        head = _HeadWeightGradient(hidden, weight, chunk_rows) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for s in range(0, hidden.shape[0], chunk_rows):
            rows = slice(s, s + chunk_rows)
            fresh = kept is None  # a recomputed product may be worked on in place
            product = _product(hidden[rows], weight, bias) if fresh else kept[rows]  # (c, V)
            grad_z = _chunk_gradient(
                product,
                fresh,
                temperature,
                lse[rows],
                targets[rows],
                threshold[rows] if threshold.numel() else None,
                grad_logprobs[rows],
                (mean_z[rows], grad_entropy[rows]) if use_entropy else None,
                out=None if head is None else head.destination(s, product.shape[0]),
            )
            grad_logits = grad_z.to(hidden.dtype) if head is None else head.add(grad_z, s)
            if need_h:
                torch.mm(grad_logits, weight, out=grad_h[rows])
            if need_b:
                grad_b += grad_logits.float().sum(0)
        weight_dtype, bias_dtype = ctx.param_dtypes
        grad_w = head.result().to(weight_dtype) if need_w else None
        grad_b = grad_b.to(bias_dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def _chunk_stats(product, kept, targets, temperature, top_p, with_entropy):
    """(log-probs of `targets`, logsumexp over the support, E_p[z] (None without entropy),
    nucleus threshold (None without a nucleus)), each (c,), of one chunk of the head's
    product (c, V) (`kept`: to be left as it is, for the backward)."""
    if top_p == 1 and fused_head.wanted(*product.shape, product.device):
        return *fused_head.chunk_stats(product, targets, temperature), None
    z = _float_logits(product, temperature, copy=kept)  # (c, V)
    picked = z.gather(1, targets[:, None]).squeeze(1)  # (c,)
    threshold = outside = None
    if top_p < 1:
        threshold = nucleus_threshold(z, top_p)
        outside = outside_support(z, threshold, targets)  # (c, V)
    # logsumexp by hand, to reuse exp(z - max) for the mean logit: 4-5 passes over the
    # chunk instead of 9 (the chunk's elementwise work rivals its matmul on CPU)
    row_max = z.amax(dim=-1)  # (c,) also the support's max: it holds the top token
    shifted = z.sub_(row_max[:, None])  # (c, V) in place
    e = shifted.exp() if with_entropy else shifted.exp_()  # (c, V)
    if outside is not None:
        e.masked_fill_(outside, 0.0)
    total = e.sum(-1)  # (c,)
    lse = row_max + total.log()
    mean_z = None
    if with_entropy:  # E_p[z] = Σ e·(z - max) / Σ e + max, one dot per row
        mean_z = torch.linalg.vecdot(e, shifted) / total + row_max  # 2x a batched matmul
    return picked - lse, lse, mean_z, threshold


def _chunk_gradient(product, fresh, temperature, lse, targets, threshold, g_lp, entropy, out=None):
    """(c, V) gradient of a chunk's loss with respect to the head's product (c, V) (its own
    dtype; `fresh`: not kept, so it may be overwritten): float32 from eager ops, in the
    product's dtype from the fused pass (`fused_head`), which writes it into `out` (the
    head's gradient buffer) when given."""
    if threshold is None and fused_head.wanted(*product.shape, product.device):
        mean_z, g_ent = entropy if entropy else (torch.zeros_like(lse),) * 2
        args = (product, lse, targets, g_lp, mean_z, g_ent, temperature)
        return fused_head.logit_gradient(*args, out=out)
    z = _float_logits(product, temperature, copy=not fresh)
    grad_z = _logit_gradient(z, lse, targets, threshold, g_lp, entropy)
    return grad_z.div_(temperature) if temperature != 1.0 else grad_z


def _logit_gradient(z, lse, targets, threshold, g_lp, entropy) -> torch.Tensor:
    """(c, V) float32 gradient of a chunk's loss with respect to its logits / T, from the
    chunk's float logits `z` (used up), its rows' logsumexp, targets and nucleus threshold
    (None: the whole vocabulary), the log-probs' gradient, and (E_p[z], the entropies'
    gradient) when the entropies have one."""
    outside = outside_support(z, threshold, targets) if threshold is not None else None
    shifted = torch.sub(z, lse[:, None]) if entropy else z.sub_(lse[:, None])
    p = shifted.exp_()  # (c, V) softmax on the support; z survives only for entropy
    if outside is not None:
        p.masked_fill_(outside, 0.0)
    g_lp = g_lp[:, None]  # (c, 1)
    # d logp_t/dz = onehot(t) - p ;  d H/dz = -p (z - E_p[z])
    # => grad_z = onehot(t) g_lp - p (g_lp + g_ent (z - E_p[z]))
    if entropy:
        mean_z, g_ent = entropy
        factor = z.sub_(mean_z[:, None]).mul_(g_ent[:, None]).add_(g_lp)
        grad_z = p.mul_(factor).neg_()
    else:
        grad_z = p.mul_(-g_lp)
    return grad_z.scatter_add_(1, targets[:, None], g_lp)


class _HeadWeightGradient:
    """The head's weight gradient, accumulated in float32 over the chunks.

    A low-precision head's chunk logit gradients gather in one buffer (up to
    `HEAD_GRAD_BUFFER_BYTES`): one matmul per buffer, then one float32 add. Per chunk, the
    float copy and add of a (V, H) product cost as much as the matmul on a CPU."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int):
        self.hidden = hidden
        self.weight = weight
        # (V, H) float32, made by the first product: zeros to add it to cost a fill of
        # the whole head (113 MB for SmolLM2, 77 ms of a 5.5 s step on a 2-core Xeon)
        self.grad: torch.Tensor | None = None
        self.buffer = None
        if weight.dtype != torch.float32:
            rows_fit = HEAD_GRAD_BUFFER_BYTES // (weight.shape[0] * hidden.element_size())
            rows = min(hidden.shape[0], max(rows_fit, chunk_rows))
            self.buffer = hidden.new_empty(rows, weight.shape[0])  # (rows, V)
        self.held = 0  # first row of `hidden` whose logit gradient the buffer holds

    def add(self, grad_z: torch.Tensor, start: int) -> torch.Tensor:
        """Take the (c, V) logit gradient of rows `start`.. (float32, or the fused pass's in the
        head's dtype); return it in the head's dtype."""
        rows = slice(start, start + grad_z.shape[0])
        if self.buffer is None:
            grad_logits = grad_z.to(self.hidden.dtype)
            if self.grad is None:
                self.grad = torch.mm(grad_logits.t(), self.hidden[rows])
            else:
                self.grad.addmm_(grad_logits.t(), self.hidden[rows])
            return grad_logits
        held = self.destination(start, grad_z.shape[0])
        return held if grad_z.data_ptr() == held.data_ptr() else held.copy_(grad_z)

    def destination(self, start: int, rows: int) -> torch.Tensor | None:
        """Where the logit gradient of rows `start`..`start + rows` goes in the buffer (the
        fused pass writes it there; a copy of 512 x 49152 cost 67 ms on a 2-core EPYC),
        once the rows before fit; None without a buffer."""
        if self.buffer is None:
            return None
        if start + rows - self.held > len(self.buffer):
            self._flush(start)
        return self.buffer[start - self.held : start + rows - self.held]

    def result(self) -> torch.Tensor:
        self._flush(self.hidden.shape[0])
        if self.grad is None:  # no rows
            return torch.zeros_like(self.weight, dtype=torch.float32)
        return self.grad

    def _flush(self, end: int) -> None:
        if self.buffer is not None and end > self.held:
            held = self.buffer[: end - self.held]  # (rows, V)
            product = (held.t() @ self.hidden[self.held : end]).float()
            self.grad = product if self.grad is None else self.grad.add_(product)
        self.held = end


def lm_head_token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` (and entropies) under softmax(lm_head(hidden).float() / T),
    truncated to the engine's top-p nucleus plus the target when `top_p < 1`.

    hidden (M, H) holds only the rows that predict a target; targets (M,).
    Returns fp32 tensors (M,), differentiable w.r.t. hidden and the head.
    Under CPU/CUDA autocast the head runs in the autocast dtype, as it would in
    an ordinary forward.
    """
    weight, bias = lm_head.weight, lm_head.bias
    device_type = hidden.device.type
    dtype = weight.dtype
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden = hidden.to(dtype)
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    options = (float(temperature), float(top_p), chunk_rows, with_entropy, dtype, keep)
    with torch.autocast(device_type, enabled=False):
        logprobs, entropy = _LMHeadLogProbs.apply(hidden, weight, bias, targets, *options)
    return logprobs, entropy if with_entropy else None
