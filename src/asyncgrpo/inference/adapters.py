"""LoRA adapter syncs: the adapter naming convention as code, and the merge the engine applies.

With `model.lora` set, the trainer publishes only the adapter, through the
unchanged `sync_weights`, under peft's saved names (the keys of
`get_peft_model_state_dict`): `base_model.model.<module>.lora_A.weight` (r, in)
and `base_model.model.<module>.lora_B.weight` (out, r). The scale alpha/r is
already multiplied into lora_B, so the update of the base weight
`<module>.weight` is exactly B @ A. Engines recognise such a sync by its names
(`is_adapter_update`), pair and check the tensors (`adapter_pairs`,
`check_against`), then merge them (the embedded engine, `AdapterMerge`) or hand
them to vLLM as a peft adapter directory (`save_peft_adapter`).

Merge, or low-rank matmuls at decode time? Measured on the embedded engine with
SmolLM2-135M (bf16, one thread, r=16 on q/k/v/o, `benchmarks/lora_apply.py`, a
shared 2-core machine): merging costs ≈ 76 ms per sync (57 ms merge and copy, 19 ms
repacking the touched linears; 114 ms the first time, which takes the base copies),
while x @ A.T @ B.T on the 120 targeted linears would add ≈ 3.7 ms to every decode
step at batch 1 (9% of a 41 ms step) and 4.4 ms at batch 16 (8% of 54 ms): merging
pays for itself after ≈ 20 decode steps. A sync comes once per trainer step, with
hundreds of decode steps between two, so the embedded engine merges.

Each sync sets W = W_base + B @ A from a copy of the base weight taken at the
first adapter sync, never from the previously merged W, so rounding never
accumulates. The copy is kept in the engine's weight dtype: the weights were
rounded to it when loaded, so the copy is exact, and an fp32 copy of a bf16
model would double its memory for nothing; the merge is computed in fp32 and
rounded once. A full-weight update makes the weights it writes the new base.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_PREFIX = "base_model.model."
LORA_A_SUFFIX = ".lora_A.weight"
LORA_B_SUFFIX = ".lora_B.weight"
ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B")
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"


class AdapterError(ValueError):
    """A malformed adapter sync; the message names the tensor or module at fault."""


def looks_like_adapter(name: str) -> bool:
    """True for any name of a LoRA tensor, well-formed or not."""
    return any(marker in name for marker in ADAPTER_MARKERS)


def is_adapter_update(names: Iterable[str]) -> bool:
    """True when every name is an adapter tensor's, False when none is; a mix is refused."""
    adapter, full = None, None
    for name in names:
        if looks_like_adapter(name):
            adapter = adapter or name
        else:
            full = full or name
        if adapter and full:
            raise AdapterError(
                f"a weight update mixes adapter tensors ('{adapter}') with full weights "
                f"('{full}'): a LoRA run publishes only the adapter"
            )
    return adapter is not None


def _split(name: str) -> tuple[str, str]:
    """(module, "A" or "B") of a well-formed adapter tensor name."""
    if not name.startswith(ADAPTER_PREFIX):
        raise AdapterError(
            f"adapter tensor '{name}' must be named as peft saves it: "
            f"'{ADAPTER_PREFIX}<module>.lora_A.weight' / '.lora_B.weight'"
        )
    for suffix, which in ((LORA_A_SUFFIX, "A"), (LORA_B_SUFFIX, "B")):
        if name.endswith(suffix):
            return name[len(ADAPTER_PREFIX) : -len(suffix)], which
    raise AdapterError(
        f"adapter tensor '{name}' is not a linear layer's lora_A.weight or lora_B.weight "
        "(names are get_peft_model_state_dict's, without the adapter name; embedding "
        "adapters are not supported)"
    )


def base_weight_name(name: str) -> str:
    """The weight an adapter tensor updates: `base_model.model.X.lora_A.weight` -> `X.weight`."""
    return _split(name)[0] + ".weight"


@dataclass(frozen=True)
class AdapterPair:
    """The two factors of one module's adapter; its update of `base_name` is `b @ a`."""

    base_name: str
    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r), alpha / r included

    @property
    def module(self) -> str:
        return self.base_name.removesuffix(".weight")

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


def adapter_pairs(named: Iterable[tuple[str, torch.Tensor]]) -> list[AdapterPair]:
    """Pair the A and B of each module, refusing a lone factor, a duplicate or a bad shape."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        module, which = _split(name)
        slot = factors.setdefault(module, {})
        if which in slot:
            raise AdapterError(f"adapter tensor '{name}' is sent twice")
        slot[which] = tensor
    pairs = []
    for module, slot in factors.items():
        missing = {"A", "B"} - slot.keys()
        if missing:
            raise AdapterError(
                f"adapter of '{module}' has no lora_{missing.pop()}: every module needs both"
            )
        pairs.append(_checked_pair(module, slot["A"], slot["B"]))
    return pairs


def _checked_pair(module: str, a: torch.Tensor, b: torch.Tensor) -> AdapterPair:
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(f"adapter of '{module}': lora_A and lora_B must be floating-point")
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise AdapterError(
            f"adapter of '{module}': lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
            "must be (r, in) and (out, r)"
        )
    return AdapterPair(module + ".weight", a, b)


def check_against(
    pairs: Iterable[AdapterPair],
    weights: Mapping[str, torch.Tensor],
    tied: Iterable[str] = (),
) -> None:
    """Refuse pairs whose base weight is missing, shares its storage with another weight
    (`tied`: merging into it would change the other too), or has another shape than B @ A."""
    tied = set(tied)
    for pair in pairs:
        weight = weights.get(pair.base_name)
        if weight is None:
            raise AdapterError(f"adapter of '{pair.module}' names no weight of the model")
        if pair.base_name in tied:
            raise AdapterError(
                f"adapter of '{pair.module}': '{pair.base_name}' is tied to another weight"
            )
        update = (pair.b.shape[0], pair.a.shape[1])
        if tuple(weight.shape) != update:
            raise AdapterError(
                f"adapter of '{pair.module}': B @ A is {update} but '{pair.base_name}' is "
                f"{tuple(weight.shape)}"
            )


class AdapterMerge:
    """The embedded engine's adapter state: a copy of each base weight an adapter targeted.

    `weights` maps names to the live weights (written only by the engine thread);
    `dtype` is the engine's weight dtype, in which the copies are kept.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self.weights = weights
        self.dtype = dtype
        self.bases: dict[str, torch.Tensor] = {}

    def merged(self, pairs: Iterable[AdapterPair]) -> list[tuple[str, torch.Tensor]]:
        """(name, float32 value) to write for this adapter: base + B @ A for each pair, and
        the plain base of any weight an earlier adapter targeted and this one does not."""
        writes, targeted = [], set()
        for pair in pairs:
            base = self.bases.get(pair.base_name)
            if base is None:
                live = self.weights[pair.base_name].detach()
                base = self.bases[pair.base_name] = live.to(self.dtype, copy=True)
            b, a = (t.to(base.device, torch.float32) for t in (pair.b, pair.a))  # base's device
            merged = torch.addmm(base.float(), b, a)  # (out, in)
            writes.append((pair.base_name, merged))
            targeted.add(pair.base_name)
        writes += [(name, base) for name, base in self.bases.items() if name not in targeted]
        return writes

    def forget(self, names: Iterable[str]) -> None:
        """A full update overwrote these weights: the next adapter merges onto the new ones."""
        for name in names:
            self.bases.pop(name, None)


def target_modules(pairs: Iterable[AdapterPair]) -> list[str]:
    """peft's `target_modules`: the distinct last components of the adapted modules."""
    return sorted({pair.module.rsplit(".", 1)[-1] for pair in pairs})


def peft_adapter_config(pairs: list[AdapterPair]) -> dict:
    """adapter_config.json of a plain LoRA whose scale is 1 (lora_alpha == r): B holds it."""
    ranks = {pair.rank for pair in pairs}
    if len(ranks) != 1:
        raise AdapterError(f"adapter ranks differ between modules: {sorted(ranks)}")
    rank = ranks.pop()
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": target_modules(pairs),
        "use_rslora": False,
        "use_dora": False,
    }


def save_peft_adapter(pairs: list[AdapterPair], directory: str | Path) -> Path:
    """Write the adapter as a peft adapter directory (what peft and vLLM load).

    Written under a temporary name and renamed, so a reader never sees half of it.
    """
    from safetensors.torch import save_file

    if not pairs:
        raise AdapterError("an adapter sync with no tensors")
    directory = Path(directory)
    config = peft_adapter_config(pairs)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = {}
    for pair in pairs:
        name = ADAPTER_PREFIX + pair.module
        tensors[name + LORA_A_SUFFIX] = pair.a.detach().contiguous().cpu()
        tensors[name + LORA_B_SUFFIX] = pair.b.detach().contiguous().cpu()
    save_file(tensors, str(partial / PEFT_WEIGHTS_FILE))
    (partial / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(partial, directory)
    return directory
