"""The CUDA IPC weight handover as data: the message's round trip, its refusals, and the
acknowledgement. No CUDA handle can be made without a GPU, so the handles here are
made-up bytes in the shape `reduce_tensor` gives them (test_paged_cuda.py opens real
ones on a GPU)."""

from __future__ import annotations

import base64
import inspect
import json
import re

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from asyncgrpo.inference.engine.paged.handover import (
    REBUILD_ARGUMENTS,
    CudaRequired,
    HandoverAck,
    HandoverMismatch,
    SharedTensor,
    WeightHandover,
    open_shared,
    share_tensor,
    shared_from_reduction,
)

ENGINE = {"w": (torch.bfloat16, (4, 3)), "b": (torch.float32, (3,))}


def reduction(shape=(4, 3), stride=(3, 1), dtype=torch.bfloat16, offset=6, size=64) -> tuple:
    """Arguments as reduce_tensor returns them for a CUDA tensor (made-up handles)."""
    return (
        torch.nn.Parameter, torch.Size(shape), stride, offset, torch.storage.TypedStorage,
        dtype, 0, b"\x00handle\xff", size, 512, True, b"counter", 2, b"event\x01", True,
    )  # fmt: skip


def message(version: int = 7) -> WeightHandover:
    tensors = (
        shared_from_reduction("w", reduction()),
        shared_from_reduction("b", reduction((3,), (1,), torch.float32, 0, 12)),
    )
    return WeightHandover(version, tensors)


def test_the_argument_order_is_this_torch_s_rebuild_cuda_tensor():
    assert tuple(inspect.signature(rebuild_cuda_tensor).parameters) == REBUILD_ARGUMENTS


def test_a_message_survives_json_and_gives_back_the_rebuild_arguments():
    sent = message()
    text = sent.to_json()
    json.loads(text)  # plain JSON, no pickle
    received = WeightHandover.from_json(text)
    assert received == sent
    args = received.tensors[0].reduction_args()
    original = reduction()
    # a plain tensor without gradient on the engine side; everything else as produced
    assert args[0] is torch.Tensor and args[10] is False
    assert args[1:10] + args[11:] == original[1:10] + original[11:]
    assert received.tensors[1].dtype == "float32" and received.tensors[1].shape == (3,)


def test_no_event_handle_is_carried_as_null():
    args = list(reduction())
    args[13] = None
    shared = shared_from_reduction("w", args)
    back = WeightHandover.from_json(WeightHandover(1, (shared,)).to_json())
    assert back.tensors[0].reduction_args()[13] is None


def test_another_torch_s_argument_count_is_refused():
    with pytest.raises(HandoverMismatch, match="14 rebuild arguments, expected 15"):
        shared_from_reduction("w", reduction()[:14])


def test_names_dtypes_and_shapes_must_be_the_engine_s():
    message().check_against(ENGINE)
    cases = {
        "missing: c": {**ENGINE, "c": (torch.float32, (1,))},
        "not parameters of the engine: b": {"w": ENGINE["w"]},
        "w: dtype bfloat16, the engine's is float16": {**ENGINE, "w": (torch.float16, (4, 3))},
        "w: shape [4, 3], the engine's is [3, 4]": {**ENGINE, "w": (torch.bfloat16, (3, 4))},
    }
    for problem, engine in cases.items():
        with pytest.raises(HandoverMismatch, match=r"version 7 refused: .*" + re.escape(problem)):
            message().check_against(engine)


def edited(change) -> str:
    data = json.loads(message().to_json())
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d.update(version=-1), "non-negative integer"),
        (lambda d: d.update(version=True), "non-negative integer"),
        (lambda d: d["tensors"].append(d["tensors"][0]), "named more than once: w"),
        (lambda d: d["tensors"][0].update(dtype="Tensor"), "malformed"),
        (lambda d: d["tensors"][0].update(shape=[4, -3]), "malformed"),
        (lambda d: d["tensors"][0]["handle"].update(storage_handle="%%"), "malformed"),
        (lambda d: d["tensors"][0]["handle"].pop("event_handle"), "malformed"),
        (lambda d: d["tensors"][0]["handle"].update(extra=1), "malformed"),
        (lambda d: d["tensors"][0]["handle"].update(tensor_offset="6"), "malformed"),
        (lambda d: d["tensors"][0]["handle"].update(tensor_stride=[3]), "strides"),
        (lambda d: d["tensors"][0]["handle"].update(storage_size_bytes=34), "byte 36 of a 34"),
        (lambda d: d.pop("tensors"), "malformed"),
    ],
)
def test_a_malformed_message_is_refused(change, problem):
    with pytest.raises(HandoverMismatch, match=problem):
        WeightHandover.from_json(edited(change))


def test_the_largest_offset_that_fits_its_storage_is_accepted():
    # offset 6 + 3*3 + 2*1 = element 17, bytes 34..35 of the storage
    shared = shared_from_reduction("w", reduction(size=36))
    WeightHandover.from_json(WeightHandover(0, (shared,)).to_json())


def test_the_acknowledgement_must_name_the_version_and_every_tensor():
    sent = message(version=3)
    ack = HandoverAck.from_json(HandoverAck(3, ("b", "w")).to_json())
    ack.confirms(sent)
    with pytest.raises(HandoverMismatch, match="version 2, the handover sent 3"):
        HandoverAck(2, ("b", "w")).confirms(sent)
    with pytest.raises(HandoverMismatch, match="other tensors"):
        HandoverAck(3, ("w",)).confirms(sent)
    with pytest.raises(HandoverMismatch, match="malformed"):
        HandoverAck.from_json('{"version": 3}')


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_handles_need_cuda():
    with pytest.raises(CudaRequired, match="needs CUDA"):
        share_tensor("w", torch.zeros(2))
    handle = dict(message().tensors[0].handle)
    handle["storage_handle"] = base64.b64encode(b"x").decode()
    with pytest.raises(CudaRequired, match="needs CUDA"):
        open_shared(SharedTensor("w", "bfloat16", (4, 3), handle))
