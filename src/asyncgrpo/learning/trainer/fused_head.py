"""The LM head's per-chunk log-softmax passes as one compiled kernel each, on a CPU.

`logprobs._LMHeadLogProbs` turns each chunk of head logits (rows x vocabulary) into
log-probs and entropies, and back into logit gradients. Done with eager ops, that is
5-9 passes over a (512, 49152) float32 chunk, each a 100 MB round trip to memory,
some with an `exp`: on a 2-core Xeon they took longer than the chunk's matmuls.
`torch.compile` fuses each direction into one pass that reads the head's own product
(bf16 under autocast) and, backward, writes the gradient in that dtype: per 512-row
chunk of SmolLM2's vocabulary at 2 threads, 67.6 -> 14.4 ms forward and 151 -> 27 ms
backward (`benchmarks/head_passes.py`: the whole head 1.67x, a training step 1.07x).

Only large chunks take this path (`FUSE_MIN_ELEMENTS`): a compile costs ~12 s once a
process (inductor caches the code on disk), which tests' tiny models would not win
back. A GPU keeps the eager path (not measured there), and so does a CPU where the
compile fails (no C++ compiler): the error is logged once and eager ops take over.
The nucleus (`top_p < 1`) path stays eager too.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

FUSE_MIN_ELEMENTS = 1 << 22  # a chunk of rows x vocabulary at least this large is fused
_state: dict = {"broken": False, "compiled": None}


def wanted(rows: int, vocab: int, device: torch.device) -> bool:
    """Whether a chunk of `rows` x `vocab` head logits goes through the compiled passes."""
    return (
        device.type == "cpu"
        and rows * vocab >= FUSE_MIN_ELEMENTS
        and not _state["broken"]
        and not torch.compiler.is_compiling()
    )


@contextlib.contextmanager
def eager_passes():
    """Every chunk through eager ops inside this block (a benchmark's A/B)."""
    global FUSE_MIN_ELEMENTS
    fuse_from, FUSE_MIN_ELEMENTS = FUSE_MIN_ELEMENTS, 1 << 62
    try:
        yield
    finally:
        FUSE_MIN_ELEMENTS = fuse_from


def _stats(product: torch.Tensor, targets: torch.Tensor, temperature: float):
    z = product.float() / temperature  # (c, V)
    row_max = z.amax(dim=-1, keepdim=True)  # (c, 1)
    shifted = z - row_max
    e = shifted.exp()
    total = e.sum(dim=-1)  # (c,)
    lse = row_max.squeeze(1) + total.log()
    picked = z.gather(1, targets[:, None]).squeeze(1)
    mean_z = (e * shifted).sum(dim=-1) / total + row_max.squeeze(1)  # E_p[z]
    return picked - lse, lse, mean_z


def _gradient(product, lse, targets, g_lp, mean_z, g_ent, temperature: float):
    # d logp_t/dz = onehot(t) - p ;  d H/dz = -p (z - E_p[z]) ; z = product / T
    z = product.float() / temperature  # (c, V)
    p = (z - lse[:, None]).exp()
    factor = (z - mean_z[:, None]) * g_ent[:, None] + g_lp[:, None]
    columns = torch.arange(z.shape[1], device=z.device)
    onehot = torch.where(columns == targets[:, None], g_lp[:, None], 0.0)
    return ((onehot - p * factor) / temperature).to(product.dtype)


def _gradient_into(out, product, lse, targets, g_lp, mean_z, g_ent, temperature: float):
    return out.copy_(_gradient(product, lse, targets, g_lp, mean_z, g_ent, temperature))


def chunk_stats(product: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(log-probs of `targets`, logsumexp, E_p[z]) per row of softmax(product / T), all
    (c,) float32, from the head's product (c, V) in any dtype, in one pass."""
    return _run(0, _stats, product, targets, temperature)


def logit_gradient(product, lse, targets, g_lp, mean_z, g_ent, temperature: float, out=None):
    """The (c, V) gradient, in the product's dtype, of Σ g_lp·logp_t + Σ g_ent·H with
    respect to the head's product, for rows of logsumexp `lse` and mean logit `mean_z`
    (from `chunk_stats`); `g_ent` zeros when the entropies have no gradient. Written into
    `out` (returned) when given: the pass stores there, with no (c, V) tensor between."""
    args = (product, lse, targets, g_lp, mean_z, g_ent, temperature)
    if out is None:
        return _run(1, _gradient, *args)
    return _run(2, _gradient_into, out, *args)


def _run(which: int, eager, *args):
    if not _state["broken"]:
        if _state["compiled"] is None:  # lazily: torch.compile's first call costs 2.4 s
            _state["compiled"] = [
                torch.compile(f, dynamic=True) for f in (_stats, _gradient, _gradient_into)
            ]
        try:
            return _state["compiled"][which](*args)
        except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager
            _state["broken"] = True
            logger.warning("the LM head's fused passes did not compile (%s); eager ops run", error)
    return eager(*args)
