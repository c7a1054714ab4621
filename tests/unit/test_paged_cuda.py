"""The paged pieces on a CUDA GPU: Triton's FlexAttention over the block tables, and a
weight handover over real CUDA IPC handles between two processes.

Marked `gpu`: skipped where torch sees no CUDA device. The CPU tests
(test_paged_attention.py, test_weight_handover.py) check the same math and messages;
these check what only a GPU shows: that the compiled Triton kernels accept the block
masks as built here (block tables as narrow as a sequence's most blocks, and as wide
as the pool, as the CPU needs), the GQA folding, bfloat16, and that `open_shared`
maps another process's allocation. Tolerances: float32 as on the CPU with TF32 off
(2e-6); bfloat16 pools and outputs round to 2^-9 relative, outputs of a few units:
5e-2 of the float64 reference (a leak moves them by ~1).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_paged_attention import (
    HEADS,
    SEQS,
    Scenario,
    decode_reference,
    packed_queries,
    prefill_meta,
    reference,
)

from asyncgrpo.inference.engine.paged.attention import decode_attention, prefill_attention
from asyncgrpo.inference.engine.paged.handover import (
    HandoverAck,
    WeightHandover,
    share_tensor,
)

pytestmark = pytest.mark.gpu

CUDA_DIM = 64  # Triton's flex kernels need head dims >= 16
# a block smaller than the kernel's default key tile needs a tile that divides it
BLOCKS_AND_TILES = [(16, {"BLOCK_N": 16}), (128, None)]


@pytest.fixture(autouse=True)
def require_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # flex's Triton dots in IEEE float32
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(("block", "options"), BLOCKS_AND_TILES, ids=["block16", "block128"])
@pytest.mark.parametrize("wide", [False, True], ids=["sequence-wide", "pool-wide"])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"]
)
def test_compiled_paged_attention_on_cuda_matches_the_reference(
    block, options, wide, dtype, tolerance
):
    scene = Scenario(dtype, block=block, dim=CUDA_DIM, device="cuda")
    if wide:
        scene.width = scene.cache.num_blocks
    key_pool, value_pool = scene.cache.pools(0)
    q = torch.randn(len(SEQS), HEADS, CUDA_DIM, device="cuda", dtype=dtype)
    meta = scene.decode_meta()
    out = decode_attention(q, key_pool, value_pool, meta, kernel_options=options)
    torch.testing.assert_close(
        out.double().cpu(), decode_reference(scene, q), rtol=0, atol=tolerance
    )
    pairs, rows, positions = packed_queries(scene)
    q = torch.randn(len(pairs), HEADS, CUDA_DIM, device="cuda", dtype=dtype)
    meta = prefill_meta(scene, rows, positions, tile=128)
    out = prefill_attention(q, key_pool, value_pool, meta, kernel_options=options)
    want = torch.stack([reference(q[i], *scene.kv[s], p) for i, (s, p) in enumerate(pairs)])
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=tolerance)


ENGINE_SIDE = """
import sys, torch
from asyncgrpo.inference.engine.paged.handover import HandoverAck, WeightHandover, open_shared
message = WeightHandover.from_json(sys.stdin.read())
params = {"w": torch.zeros(64, 32, device="cuda", dtype=torch.bfloat16)}
message.check_against({n: (p.dtype, p.shape) for n, p in params.items()})
for shared in message.tensors:
    params[shared.name].copy_(open_shared(shared))
torch.cuda.synchronize()
print(float(params["w"].double().sum()))
print(HandoverAck(message.version, tuple(t.name for t in message.tensors)).to_json())
"""


def test_a_weight_handover_copies_the_trainer_s_tensor_in_another_process():
    weights = torch.randn(64, 32, device="cuda").to(torch.bfloat16)
    message = WeightHandover(5, (share_tensor("w", weights),))
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_SIDE],
        input=message.to_json(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    total, ack = done.stdout.strip().splitlines()[-2:]
    HandoverAck.from_json(ack).confirms(message)
    assert float(total) == pytest.approx(float(weights.double().sum()), abs=1e-6)
