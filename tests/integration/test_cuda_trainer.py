"""The trainer on a CUDA GPU (`trainer.device`) equals the trainer on the CPU, FSDP2 runs
its steps there over NCCL, and `asyncgrpo train` trains on it with the embedded engine.

Marked `gpu` (`make test-gpu`): skipped where torch sees no CUDA device. The
comparisons use float64 weights, as test_data_parallel.py does, on the same batches.
The log-prob kernels compute in float32, so CPU and GPU gradients differ by float32
rounding (summed in another order: measured 3e-9 against gradients of 6e-3 on an
H100), which Adam's first steps magnify for near-zero gradients (weights 1.2e-5 apart
after three steps). So the first step's gradients are compared tightly, and the
weights after three steps within 1e-4, far below the steps' own movement (asserted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_data_parallel import LORA, batches, config, train
from test_train import start_cli, train_rows, write_recipe

from asyncgrpo.learning.trainer.build import load_policy, policy_trainer
from asyncgrpo.learning.trainer.data_parallel import DataParallelTrainer
from asyncgrpo.learning.trainer.distributed import leave, start_world
from asyncgrpo.testing import save_tiny_model_dir

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-4  # after three steps; the weights move by > 1e-2 (checked)


@pytest.fixture(autouse=True)
def require_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # exact float32 products on both sides (TF32 would round to 10 mantissa bits)
    torch.backends.cuda.matmul.allow_tf32 = False


def trainer_on(device: str, tmp_path: Path, model_dir: Path, attention="auto", **sections):
    cfg = config(tmp_path, model_dir, "dapo", 1, **sections)
    cfg.trainer.device = device
    cfg.trainer.attention = attention
    torch.manual_seed(0)  # the same LoRA initialisation on both
    return policy_trainer(cfg, load_policy(cfg, str(model_dir)).double())


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in trainer.named_weights()}


def assert_same_training(expected, actual, initial, expected_metrics, actual_metrics):
    moved = 0.0
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=TOLERANCE, rtol=0)
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 1e-2
    for a, b in zip(expected_metrics, actual_metrics, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def first_gradients(trainer, groups) -> dict[str, torch.Tensor]:
    """The gradients of one batch, before any optimizer step (then cleared)."""
    trainer.accumulate(trainer.prepare(groups))
    grads = {
        name: p.grad.detach().cpu().clone()
        for name, p in trainer.model.named_parameters()
        if p.grad is not None
    }
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "attention, sections",
    [
        ("mask", {}),
        ("segments", {}),
        ("mask", {"loss": {"beta": 0.1}}),
        ("mask", {"model": {"lora": LORA}, "loss": {"beta": 0.1}}),
    ],
    ids=["full", "full-segments", "kl", "lora-kl"],
)
def test_a_step_on_the_gpu_equals_a_step_on_the_cpu(tmp_path, attention, sections):
    """The GPU's attention (`mask`, auto's choice there, or `segments`) against the
    CPU's per-segment attention."""
    model_dir = save_tiny_model_dir(tmp_path / "model")
    cpu = trainer_on("cpu", tmp_path, model_dir, **sections)
    gpu = trainer_on("cuda", tmp_path, model_dir, attention, **sections)
    assert cpu.attention == "segments" and gpu.attention == attention
    assert next(gpu.model.parameters()).device.type == "cuda"
    initial = weights(cpu)
    data = batches()
    cpu_grads, gpu_grads = first_gradients(cpu, data[0]), first_gradients(gpu, data[0])
    assert cpu_grads.keys() == gpu_grads.keys() and cpu_grads
    for name, grad in cpu_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(gpu_grads[name], grad, atol=1e-5 * scale + 1e-12, rtol=0)
    cpu_metrics, gpu_metrics = train(cpu, data), train(gpu, data)
    assert_same_training(weights(cpu), weights(gpu), initial, cpu_metrics, gpu_metrics)


def test_varlen_kernel_on_the_gpu_equals_the_block_mask_attention():
    """The flash varlen call (`trainer/varlen.py`) over a packed row with shared prompts and
    grouped KV heads, in bf16, against fp32 attention with the dense block mask on the
    same bf16 values: outputs and gradients within bf16 rounding."""
    from asyncgrpo.learning.trainer.packing import pack_sequences
    from asyncgrpo.learning.trainer.varlen import varlen_attention, varlen_available, varlen_layout

    assert varlen_available()
    p1, p2 = list(range(1, 8)), [40, 41, 42]
    seqs = [p1 + [9] * 5, list(range(20, 29)), p1 + [8], p2 + [7] * 4, p1 + [6] * 8, p2 + [5, 5]]
    packed = pack_sequences(seqs, [7, 4, 7, 3, 7, 3])
    n, device = packed.input_ids.shape[1], torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 4, n, 64), (1, 2, n, 64), (1, 2, n, 64)]  # query, key, value: GQA 2:1
    halves = [torch.randn(s, generator=g).to(device, torch.bfloat16) for s in shapes]
    halves = [t.requires_grad_() for t in halves]
    fulls = [t.detach().float().requires_grad_() for t in halves]
    mask = packed.block_mask().to(device)
    want = torch.nn.functional.scaled_dot_product_attention(
        *fulls, attn_mask=mask, scale=0.1, enable_gqa=True
    ).transpose(1, 2)
    got = varlen_attention(*halves, varlen_layout(packed.segments, device), 0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    weights = torch.randn(want.shape, generator=g).to(device)
    want_grads = torch.autograd.grad((want * weights).sum(), fulls)
    got_grads = torch.autograd.grad((got.float() * weights).sum(), halves)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=2e-2)


def test_bf16_trainer_with_varlen_attention_has_the_mask_gradients(tmp_path, monkeypatch):
    """Under bf16 autocast, `trainer.attention: varlen` runs the varlen kernel (not the
    per-segment fallback) and gives the first gradients of the dense-mask path to bf16
    precision."""
    from asyncgrpo.learning.trainer import packing

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return varlen_attention(*args, **kwargs)

    varlen_attention = packing.varlen_attention
    monkeypatch.setattr(packing, "varlen_attention", counted)
    model_dir = save_tiny_model_dir(tmp_path / "model")
    trainers = {}
    for attention in ("varlen", "mask"):
        cfg = config(tmp_path, model_dir, "dapo", 1)
        cfg.trainer.device, cfg.trainer.attention, cfg.trainer.bf16_autocast = (
            "cuda",
            attention,
            True,
        )
        trainers[attention] = policy_trainer(cfg, load_policy(cfg, str(model_dir)))
    data = batches()[0]
    varlen_grads = first_gradients(trainers["varlen"], data)
    assert calls, "the varlen trainer never called the varlen kernel"
    mask_grads = first_gradients(trainers["mask"], data)
    for name, want in mask_grads.items():
        error = float((varlen_grads[name] - want).norm() / want.norm())
        assert error < 3e-2, f"{name}: relative gradient error {error:.2e}"


def test_fsdp2_over_nccl_on_one_gpu_equals_the_unsharded_trainer(tmp_path):
    """The sharded path end to end on a GPU (device mesh, NCCL all-gathers and
    reduce-scatters, full-tensor gathers for publishing and checkpoints), one rank."""
    model_dir = save_tiny_model_dir(tmp_path / "model")
    plain = trainer_on("cuda", tmp_path, model_dir)
    initial = weights(plain)
    plain_metrics = train(plain, batches())

    core = trainer_on("cuda", tmp_path, model_dir)
    param = next(core.model.parameters())
    world = start_world(1, tmp_path, str(model_dir), param, timeout_s=120)
    try:
        assert torch.distributed.get_backend() == "nccl"
        sharded = DataParallelTrainer(core, world, "fsdp")
        sharded.start()
        assert all(hasattr(p, "device_mesh") for p in core.model.parameters())
        sharded_metrics = train(sharded, batches())
        published = {name: t.cpu() for name, t in sharded.named_weights()}
        saved = sharded.save_checkpoint(tmp_path / "checkpoints", state(3))
    finally:
        leave(world)
    assert_same_training(weights(plain), published, initial, plain_metrics, sharded_metrics)
    assert (saved / "model.safetensors").exists()


def state(step: int):
    from asyncgrpo.learning.trainer.checkpoint import TrainingState

    return TrainingState(step, step, {}, {})


def test_asyncgrpo_train_runs_its_trainer_on_the_gpu(tmp_path, tiny_model_dir):
    """The CLI with `trainer.device: cuda`: the embedded engine generates on the CPU,
    weights cross from the GPU through shared memory, versions advance every step."""
    recipe = write_recipe(
        tmp_path, tiny_model_dir, "cuda-run", **{"trainer.device": "cuda", "max_steps": 4}
    )
    log = tmp_path / "train.log"
    proc = start_cli(str(recipe), log=log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    rows = train_rows(tmp_path / "cuda-run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the recipe trains on-policy only: each step's groups came from the previous step's
    # weights, which therefore reached the engine from the GPU
    assert all(r["staleness_max"] == 0 for r in rows)
    assert "trainer on cuda:0" in log.read_text()
