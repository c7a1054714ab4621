"""The frozen reference policy of the KL penalty (`loss.beta > 0`).

The reference is the initial policy, and its log-probs enter the loss as
k3 = exp(ref − lp) − (ref − lp) − 1 per completion token (`trainer/losses.py`).
They are computed here, without gradients, by the same packed forward as the
policy's (`packed_token_logprobs`: same packing, temperature and nucleus), so they
come back in exactly the policy's per-sequence layout and `pad_ragged` lines them up.

Memory:
- a plain model: a frozen deep copy taken when the trainer is built, i.e. one more
  model in RAM (540 MB for SmolLM2-135M in fp32), and one more forward per micro-batch.
  It must be taken before any training: a resumed run builds the trainer from the
  initial weights and loads its checkpoint in place afterwards, so the copy stays initial;
- a peft (LoRA) model: the same model with its adapter disabled, which is exactly the
  base model. Nothing is copied; the cost is the extra forward only.

Departure from TRL: TRL can also sync the reference to the policy every k steps;
here it never moves.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from asyncgrpo.learning.trainer.packing import enable_packed_attention, packed_token_logprobs


class ReferencePolicy:
    """Per-token log-probs of the reference policy for packed micro-batches.

    `model`: the module to forward (a HF causal LM); `scope`: a context manager
    factory under which that module *is* the reference (the adapter disabled), or
    None when the module is a frozen copy.
    """

    def __init__(self, model: torch.nn.Module, scope=None):
        self.model = model
        self.scope = scope
        self.runner = None  # a sharded copy's root module (`sharded.py`)

    def logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        attention: str = "segments",
        targets: Sequence[Sequence[int] | None] | None = None,
    ) -> list[torch.Tensor]:
        """Per sequence, the (C_i,) fp32 log-probs of its completion tokens (or of its
        `targets`, see `packing.packed_targets`) under the reference.

        Call it under the trainer's autocast (if any) so that both forwards match.
        """
        scope: AbstractContextManager = self.scope() if self.scope else nullcontext()
        with torch.no_grad(), scope:
            out = packed_token_logprobs(
                self.model,
                sequences,
                prompt_lengths=prompt_lengths,
                temperature=temperature,
                top_p=top_p,
                attention=attention,
                runner=self.runner,
                targets=targets,
            )
        return [lp.float() for lp in out.logprobs]


def make_reference(model: torch.nn.Module) -> ReferencePolicy:
    """The reference for `model` as it is now: adapter disabled for peft, else a frozen copy."""
    if _is_peft_model(model):
        # packed_token_logprobs needs the HF model itself; the LoRA layers it
        # contains are bypassed while the PeftModel's adapter is disabled
        return ReferencePolicy(model.get_base_model(), scope=model.disable_adapter)
    return ReferencePolicy(frozen_copy(model))


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy in eval mode whose parameters never require gradients."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    enable_packed_attention(reference)
    return reference


def _is_peft_model(model: torch.nn.Module) -> bool:
    # no import: a model can only be a PeftModel if peft is already loaded
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
