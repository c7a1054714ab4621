"""`weight_transport: nccl`: weights broadcast from the trainer's GPU into a vLLM server.

The trainer's tensors live on GPU 0 and vLLM runs on GPU 1 (NCCL refuses two ranks on
one device), both on this node. Needs two CUDA devices, a CUDA build of vllm at
`ASYNCGRPO_VLLM_PYTHON` for the server, and vllm in this environment too (the trainer
side of the NCCL group is vLLM's); skips otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import bf16_state, require_vllm, vllm_engine_config

from asyncgrpo.inference.backend.vllm import VLLMBackend

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

PROMPT = list(range(10, 22))


def require_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("NCCL weight sync needs two CUDA devices (trainer and vLLM on one each)")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the trainer side of the NCCL transport needs vllm in this environment")


def second_visible_gpu() -> str:
    """The server's CUDA_VISIBLE_DEVICES: the second device this process can see."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1].strip() if visible else "1"


@pytest.fixture(scope="module")
def nccl_backend(loop, tiny_vllm_model_dir, tmp_path_factory):
    require_two_gpus()
    require_vllm()
    cfg = vllm_engine_config(
        tiny_vllm_model_dir,
        weight_transport="nccl",
        vllm_args=["--enforce-eager", "--gpu-memory-utilization", "0.3"],
    )
    backend = VLLMBackend(cfg, log_path=tmp_path_factory.mktemp("nccl") / "vllm.log")
    backend.server.extra_env["CUDA_VISIBLE_DEVICES"] = second_visible_gpu()
    torch.cuda.set_device(0)
    try:
        loop.run(backend.wait_ready())
        yield backend
    finally:
        loop.run(backend.close(), timeout=60)


async def greedy(backend):
    completion = await backend.client.complete(
        PROMPT, max_tokens=12, temperature=0, ignore_eos=True
    )
    return completion.samples[0]


def test_nccl_sync_changes_greedy_output_and_restoring_gives_it_back(
    nccl_backend, tiny_vllm_model_dir, loop
):
    gpu = torch.device("cuda", 0)
    original = {k: v.to(gpu) for k, v in bf16_state(tiny_vllm_model_dir).items()}
    zeroed = {k: torch.zeros_like(v) if "down_proj" in k else v for k, v in original.items()}

    async def scenario():
        start = await nccl_backend.client.weight_version()
        before = await greedy(nccl_backend)
        await nccl_backend.sync_weights(zeroed.items(), start + 1, "keep")
        changed = await greedy(nccl_backend)
        await nccl_backend.sync_weights(original.items(), start + 2, "keep")
        restored = await greedy(nccl_backend)
        return start, before, changed, restored, await nccl_backend.client.weight_version()

    start, before, changed, restored, version = loop.run(scenario())
    assert changed.token_ids != before.token_ids
    assert changed.weight_versions == [start + 1] * 12  # set by /update_weight_version
    assert restored.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs)) < 1e-3
    assert restored.weight_versions == [start + 2] * 12 and version == start + 2
    assert nccl_backend.client.transfer_ready  # one group, opened by the first sync
