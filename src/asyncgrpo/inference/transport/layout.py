"""One byte layout for weights on every transport: a safetensors file image.

The trainer publishes weights as (name, tensor) pairs; the engine needs them
back as tensors without anything executable crossing the boundary (no pickle,
ever). Every backend therefore moves the same bytes: a safetensors image (an
8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw data). The shm segment, the disk file and
the http body are all valid `.safetensors` files, so any safetensors tool can
inspect them, and the reader here maps tensors as views over the buffer (zero
copies until the engine copies them into its parameters).

Writing goes straight from each tensor into its slot of a preallocated buffer
(one copy, dtype kept as given). Tensors are ordered by element size, largest
first, so every tensor starts at a multiple of its element size without the
padding the safetensors format forbids.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# torch dtype <-> safetensors dtype code
_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in _CODES.items()}
_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _CODES}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # a sanity bound on untrusted headers


class LayoutError(ValueError):
    """A weight payload whose description does not match its bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the names vLLM's `update_info` uses)."""
    if dtype not in _CODES:
        raise LayoutError(f"unsupported dtype {dtype}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Accepts "bfloat16", "torch.bfloat16" or the safetensors code "BF16"."""
    dtype = _BY_NAME.get(name.removeprefix("torch.")) or _DTYPES.get(name)
    if dtype is None:
        raise LayoutError(f"unsupported dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a buffer: absolute byte offset from the buffer start."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """A planned safetensors image: header bytes plus one slot per tensor."""

    header: bytes  # the 8-byte length prefix and the padded JSON header
    slots: tuple[TensorSlot, ...]
    total_size: int

    def describe(self) -> dict:
        """JSON-able description of the tensors (vLLM's update_info names plus offsets)."""
        return {
            "names": [s.name for s in self.slots],
            "dtype_names": [dtype_name(s.dtype) for s in self.slots],
            "shapes": [list(s.shape) for s in self.slots],
            "offsets": [s.offset for s in self.slots],
        }

    def signature(self) -> tuple:
        return tuple((s.name, s.dtype, s.shape) for s in self.slots)


def plan_layout(tensors: Iterable[tuple[str, torch.Tensor]]) -> Layout:
    """Lay tensors out as a safetensors image (largest element size first, no gaps)."""
    items = [(name, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for name, t in tensors]
    names = [name for name, *_ in items]
    if len(set(names)) != len(names):
        raise LayoutError("tensor names must be unique")
    order = sorted(range(len(items)), key=lambda i: -items[i][1].itemsize)
    entries, cursor = {}, 0
    for i in order:
        name, dtype, shape, nbytes = items[i]
        code = _CODES.get(dtype)
        if code is None:
            raise LayoutError(f"unsupported dtype {dtype} for '{name}'")
        entries[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [cursor, cursor + nbytes],
        }
        cursor += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":"))
    raw = header.encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    start = 8 + len(raw)
    slots = tuple(
        TensorSlot(name, dtype, shape, start + entries[name]["data_offsets"][0], nbytes)
        for name, dtype, shape, nbytes in (items[i] for i in order)
    )
    return Layout(struct.pack("<Q", len(raw)) + raw, slots, start + cursor)


def view(buffer, slot: TensorSlot) -> torch.Tensor:
    """The tensor of `slot` as a view over `buffer` (a writable buffer: bytearray, mmap)."""
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
    return flat.view(slot.dtype).view(slot.shape)


def write_image(buffer, layout: Layout, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill `buffer` (at least `layout.total_size` bytes) with the header and every tensor."""
    memoryview(buffer)[: len(layout.header)] = layout.header
    by_name = dict(tensors)
    with torch.no_grad():
        for slot in layout.slots:
            if slot.nbytes:
                view(buffer, slot).copy_(by_name[slot.name])


def slots_from_description(info: dict, buffer_size: int) -> list[TensorSlot]:
    """Validate a JSON description (names, dtype_names, shapes, offsets) against a buffer."""
    try:
        names, dtypes = list(info["names"]), list(info["dtype_names"])
        shapes, offsets = list(info["shapes"]), list(info["offsets"])
    except (KeyError, TypeError) as exc:
        raise LayoutError(
            f"update_info needs names, dtype_names, shapes and offsets ({exc})"
        ) from None
    if not len(names) == len(dtypes) == len(shapes) == len(offsets):
        raise LayoutError("names, dtype_names, shapes and offsets must have the same length")
    slots = []
    for name, dname, shape, offset in zip(names, dtypes, shapes, offsets):
        slots.append(
            _checked_slot(str(name), dtype_from_name(str(dname)), shape, offset, buffer_size)
        )
    return slots


def read_safetensors_slots(buffer) -> list[TensorSlot]:
    """Parse and validate the header of a safetensors image held in `buffer`."""
    size = len(memoryview(buffer))
    if size < 8:
        raise LayoutError("safetensors payload shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", bytes(memoryview(buffer)[:8]))
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise LayoutError(f"safetensors header length {header_len} exceeds the payload")
    try:
        header = json.loads(bytes(memoryview(buffer)[8 : 8 + header_len]))
    except ValueError as exc:
        raise LayoutError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise LayoutError("safetensors header must be a JSON object")
    start = 8 + header_len
    slots = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = entry["shape"]
        except (KeyError, TypeError, ValueError):
            raise LayoutError(f"bad safetensors header entry for '{name}'") from None
        slot = _checked_slot(name, dtype, shape, start + begin, size)
        if slot.nbytes != end - begin:
            raise LayoutError(f"'{name}': data_offsets do not match dtype and shape")
        slots.append(slot)
    return slots


def _checked_slot(name: str, dtype: torch.dtype, shape, offset, buffer_size: int) -> TensorSlot:
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise LayoutError(f"'{name}': shape must be a list of non-negative integers")
    if not isinstance(offset, int) or offset < 0:
        raise LayoutError(f"'{name}': offset must be a non-negative integer")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if offset + nbytes > buffer_size:
        raise LayoutError(f"'{name}': bytes [{offset}, {offset + nbytes}) lie outside the payload")
    if nbytes and offset % dtype.itemsize:
        raise LayoutError(f"'{name}': offset {offset} is not aligned to its element size")
    return TensorSlot(name, dtype, tuple(shape), offset, nbytes)
