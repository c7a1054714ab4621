"""The CUDA IPC weight handover between a trainer process and an engine process on one GPU.

On one GPU the trainer need not copy its weights anywhere: CUDA IPC lets the engine
process map the trainer's own allocations and copy from them device to device. The
trainer shares each tensor with `torch.multiprocessing.reductions.reduce_tensor`, whose
CUDA result is `rebuild_cuda_tensor` and its arguments: sizes, strides, the
allocation's IPC handle (bytes), the reference counter's handle and the event that
orders the producer's writes before the consumer's reads. This module turns those
arguments into a JSON message, with the bytes in base64 and no pickle, so it can ride
the engine's existing control channel, and checks a message against the engine's own
parameters before it opens anything.

The order, and why each step:
1. trainer: `share_tensor` for every tensor, `WeightHandover(version, tensors)`, send
   `to_json()`; it must then keep those tensors alive and unchanged (no optimizer step
   into them) until the acknowledgement: the engine reads their storage in place.
2. engine: `WeightHandover.from_json`, `check_against` its parameters (names, dtypes,
   shapes; a mismatch is refused before any handle is opened), `open_shared` each,
   copy into its parameter, synchronize, drop the opened tensors (releasing the IPC
   reference counters), answer `HandoverAck(version, names)`.
3. trainer: `HandoverAck.confirms(message)`, then its tensors are its own again.

Only a CUDA build with a device can make or open handles; `share_tensor` and
`open_shared` raise `CudaRequired` elsewhere. The message, its validation and the
mapping to and from `rebuild_cuda_tensor`'s arguments are plain data, tested on the
CPU with made-up handles.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# rebuild_cuda_tensor's parameters in order; the first and fifth are classes, set on open
REBUILD_ARGUMENTS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_BYTES = ("storage_handle", "ref_counter_handle", "event_handle")
_INTS = ("tensor_offset", "storage_device", "storage_size_bytes")
_INTS += ("storage_offset_bytes", "ref_counter_offset")


class CudaRequired(RuntimeError):
    """CUDA IPC handles can only be made and opened by a CUDA build with a device."""


class HandoverMismatch(ValueError):
    """A weight handover message that does not fit the engine, or a malformed one."""


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise CudaRequired(f"{what} needs CUDA: this process sees no CUDA device")


@dataclass(frozen=True)
class SharedTensor:
    """One tensor of a handover: its name, dtype, shape and IPC handle fields."""

    name: str
    dtype: str  # torch's name without the prefix: "bfloat16"
    shape: tuple[int, ...]
    handle: Mapping[str, Any]  # JSON-safe: rebuild arguments but the classes and shape

    def reduction_args(self) -> tuple:
        """`rebuild_cuda_tensor`'s arguments for this tensor (a plain `torch.Tensor` on
        a `TypedStorage`, no gradient)."""
        fields = dict(self.handle)
        for name in _BYTES:
            value = fields[name]
            fields[name] = None if value is None else base64.b64decode(value)
        fields.update(
            tensor_cls=torch.Tensor,
            tensor_size=torch.Size(self.shape),
            tensor_stride=tuple(fields["tensor_stride"]),
            storage_cls=torch.storage.TypedStorage,
            dtype=getattr(torch, self.dtype),
            requires_grad=False,
        )
        return tuple(fields[name] for name in REBUILD_ARGUMENTS)


def shared_from_reduction(name: str, args: Sequence[Any]) -> SharedTensor:
    """A `SharedTensor` from `reduce_tensor`'s CUDA arguments (`args`, in
    `REBUILD_ARGUMENTS` order)."""
    if len(args) != len(REBUILD_ARGUMENTS):
        raise HandoverMismatch(
            f"{name}: {len(args)} rebuild arguments, expected {len(REBUILD_ARGUMENTS)} "
            "(this torch's reduce_tensor differs from the one this module knows)"
        )
    fields = dict(zip(REBUILD_ARGUMENTS, args, strict=True))
    handle: dict[str, Any] = {name_: int(fields[name_]) for name_ in _INTS}
    handle["tensor_stride"] = [int(s) for s in fields["tensor_stride"]]
    handle["event_sync_required"] = bool(fields["event_sync_required"])
    for field in _BYTES:
        value = fields[field]
        handle[field] = None if value is None else base64.b64encode(value).decode("ascii")
    dtype = str(fields["dtype"]).removeprefix("torch.")
    return SharedTensor(name, dtype, tuple(int(s) for s in fields["tensor_size"]), handle)


def share_tensor(name: str, tensor: torch.Tensor) -> SharedTensor:
    """Share a CUDA tensor for the handover (the caller keeps it alive until the ack)."""
    _require_cuda("sharing a tensor over CUDA IPC")
    if tensor.device.type != "cuda":
        raise CudaRequired(f"{name} is on {tensor.device}, not on a CUDA device")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor.detach())
    return shared_from_reduction(name, args)


def open_shared(shared: SharedTensor) -> torch.Tensor:
    """The producer's tensor, mapped into this process (copy out of it, then drop it)."""
    _require_cuda("opening a CUDA IPC handle")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*shared.reduction_args())


@dataclass(frozen=True)
class WeightHandover:
    """The trainer's message: weight version `version`, and its shared tensors."""

    version: int
    tensors: tuple[SharedTensor, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "handle": t.handle}
                    for t in self.tensors
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> WeightHandover:
        """The message, its structure checked (any fault: HandoverMismatch)."""
        try:
            data = json.loads(text)
            version = data["version"]
            entries = data["tensors"]
            tensors = tuple(_shared_from_entry(entry) for entry in entries)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HandoverMismatch(f"malformed weight handover message: {exc!r}") from None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise HandoverMismatch(f"version must be a non-negative integer, got {version!r}")
        names = [t.name for t in tensors]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise HandoverMismatch(f"tensors named more than once: {', '.join(repeated)}")
        for shared in tensors:
            _check_extent(shared)
        return cls(version, tensors)

    def check_against(self, expected: Mapping[str, tuple[torch.dtype, Sequence[int]]]) -> None:
        """Refuse a message that does not match the engine's parameters (name -> (dtype,
        shape)) exactly: every parameter once, each with its dtype and shape."""
        given = {t.name: t for t in self.tensors}
        problems = []
        missing = sorted(set(expected) - set(given))
        unknown = sorted(set(given) - set(expected))
        if missing:
            problems.append(f"missing: {', '.join(missing)}")
        if unknown:
            problems.append(f"not parameters of the engine: {', '.join(unknown)}")
        for name in sorted(set(given) & set(expected)):
            dtype, shape = expected[name]
            want_dtype = str(dtype).removeprefix("torch.")
            if given[name].dtype != want_dtype:
                problems.append(f"{name}: dtype {given[name].dtype}, the engine's is {want_dtype}")
            if given[name].shape != tuple(shape):
                problems.append(
                    f"{name}: shape {list(given[name].shape)}, the engine's is {list(shape)}"
                )
        if problems:
            raise HandoverMismatch(
                f"weight handover version {self.version} refused: " + "; ".join(problems)
            )


@dataclass(frozen=True)
class HandoverAck:
    """The engine's answer once it has copied every tensor of a handover: until the
    trainer has it, the trainer's shared tensors must stay alive and unchanged."""

    version: int
    names: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "names": list(self.names)})

    @classmethod
    def from_json(cls, text: str | bytes) -> HandoverAck:
        try:
            data = json.loads(text)
            version, names = data["version"], tuple(data["names"])
        except (ValueError, KeyError, TypeError) as exc:
            raise HandoverMismatch(f"malformed handover acknowledgement: {exc!r}") from None
        if not isinstance(version, int) or not all(isinstance(n, str) for n in names):
            raise HandoverMismatch(f"malformed handover acknowledgement: {data!r}")
        return cls(version, names)

    def confirms(self, message: WeightHandover) -> None:
        """Raise unless this acknowledges exactly `message`'s version and tensors."""
        if self.version != message.version:
            raise HandoverMismatch(
                f"acknowledgement of version {self.version}, the handover sent {message.version}"
            )
        if sorted(self.names) != sorted(t.name for t in message.tensors):
            raise HandoverMismatch(
                f"version {self.version}: the engine copied other tensors than were sent"
            )


def _shared_from_entry(entry: Mapping[str, Any]) -> SharedTensor:
    handle = dict(entry["handle"])
    fields = {*_INTS, *_BYTES, "tensor_stride", "event_sync_required"}
    if set(handle) != fields:
        raise ValueError(f"{entry.get('name')!r}: handle fields {sorted(handle)}")
    integers = [handle[name] for name in _INTS] + list(handle["tensor_stride"])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in integers):
        raise ValueError(f"{entry.get('name')!r}: handle numbers {integers}")
    if not isinstance(handle["event_sync_required"], bool):
        raise ValueError(f"{entry.get('name')!r}: event_sync_required must be true or false")
    for name in _BYTES:
        if handle[name] is not None:
            base64.b64decode(handle[name], validate=True)
    name, dtype = entry["name"], entry["dtype"]
    if not isinstance(name, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"{name!r}: not a tensor name and dtype ({dtype!r})")
    shape = tuple(entry["shape"])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"{name}: shape {list(shape)}")
    return SharedTensor(name, dtype, shape, handle)


def _check_extent(shared: SharedTensor) -> None:
    """The tensor must lie inside the storage its handle names: a message cannot make
    the engine read past the producer's allocation."""
    stride = shared.handle["tensor_stride"]
    if len(stride) != len(shared.shape):
        raise HandoverMismatch(f"{shared.name}: strides {stride} for shape {list(shared.shape)}")
    element = torch.empty((), dtype=getattr(torch, shared.dtype)).element_size()
    if 0 in shared.shape:
        return
    last = shared.handle["tensor_offset"] + sum(
        (n - 1) * s for n, s in zip(shared.shape, stride, strict=True)
    )
    if (last + 1) * element > shared.handle["storage_size_bytes"]:
        raise HandoverMismatch(
            f"{shared.name}: reaches byte {(last + 1) * element} of a "
            f"{shared.handle['storage_size_bytes']}-byte storage"
        )
