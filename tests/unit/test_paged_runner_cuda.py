"""The paged runner and the sampler on a CUDA GPU: the same numbers as on the CPU.

Marked `gpu`: skipped where torch sees no CUDA device. On the CPU the paged runner is
tested bit for bit against the slot runner (test_paged_runner.py); these check what
only a GPU shows: that the runner's tensors all live on the model's device, that
FlexAttention's compiled kernels over the pools give the CPU's logits (float32, TF32
off), that greedy decoding follows the model's own forward for 64 tokens (the trainer's
argmax), the bfloat16 log-prob gap between engine and trainer (printed), and that
seeded sampling draws the same tokens on both devices (its uniforms come from the host).
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.inference.engine.paged.runner import PagedModelRunner
from asyncgrpo.inference.engine.runner import ModelRunner
from asyncgrpo.inference.engine.sampling import RowParams, sample
from asyncgrpo.testing import build_tiny_llama

pytestmark = pytest.mark.gpu

BLOCK = 16
VOCAB = 512


@pytest.fixture(autouse=True)
def require_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _model(dtype: torch.dtype, device: str):
    """head_dim 64 (Triton's flex kernels need 16 or more), two kv heads for four."""
    model = build_tiny_llama(
        VOCAB, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
        max_position_embeddings=1024,
    )  # fmt: skip
    return model.to(device=device, dtype=dtype)


def _scenario(runner) -> list[torch.Tensor]:
    """Two prompts, each forked into two samples, then four decode steps; all logits."""
    prompts = [
        [(7 + 3 * i) % (VOCAB - 3) + 3 for i in range(2 * BLOCK + 5)],
        [(11 + 5 * i) % (VOCAB - 3) + 3 for i in range(BLOCK + 9)],
    ]
    out = [runner.prefill([0, 2], prompts, [0, 0])]
    runner.copy_slot(0, 1, len(prompts[0]))
    runner.copy_slot(2, 3, len(prompts[1]))
    lengths = torch.tensor([len(prompts[0])] * 2 + [len(prompts[1])] * 2)
    for step in range(4):
        tokens = torch.tensor([3 + step, 40 + step, 5 + step, 60 + step])
        out.append(runner.decode(tokens, lengths + step))
    return [logits.cpu() for logits in out]


@pytest.mark.parametrize("attention", ["flex", "gather"])
def test_the_paged_runner_on_cuda_computes_the_cpu_runners_logits(attention):
    expected = _scenario(ModelRunner(_model(torch.float32, "cpu"), 4, 256))
    runner = PagedModelRunner(_model(torch.float32, "cuda"), 4, 256, BLOCK, 8, attention)
    for got, want in zip(_scenario(runner), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _greedy(runner, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from the runner."""
    logits = runner.prefill([0], [prompt], [0])
    tokens, logprobs = [], []
    for _ in range(steps):
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(float(logp[token]))
        position = torch.tensor([len(prompt) + len(tokens) - 1])
        logits = runner.decode(torch.tensor([token]), position)
    return tokens, logprobs


def _trainer_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's own forward over the whole sequence: each token's log-prob."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(tokens, device="cuda").unsqueeze(1))[:, 0].cpu()


def test_greedy_decoding_on_cuda_follows_the_models_argmax_for_64_tokens():
    model = _model(torch.float32, "cuda")
    runner = PagedModelRunner(model, 2, 256, BLOCK, attention="flex")
    prompt = [(13 + 7 * i) % (VOCAB - 3) + 3 for i in range(20)]
    tokens, _ = _greedy(runner, prompt, 64)
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        argmax = model(ids).logits[0, len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    assert tokens == argmax


def test_bf16_engine_and_trainer_log_probs_stay_close():
    model = _model(torch.bfloat16, "cuda")
    runner = PagedModelRunner(model, 2, 256, BLOCK, attention="flex")
    prompt = [(17 + 3 * i) % (VOCAB - 3) + 3 for i in range(24)]
    tokens, engine = _greedy(runner, prompt, 64)
    gap = (torch.tensor(engine) - _trainer_logprobs(model, prompt, tokens)).abs()
    print(
        f"bf16 engine vs trainer log-prob gap over 64 tokens: mean {gap.mean():.4f} max {gap.max():.4f}"
    )
    assert gap.mean() < 0.05 and gap.max() < 0.5


def _rows(vocab: int) -> list[RowParams]:
    settings = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.2, 1.0, 50), (0.0, 1.0, 0), (1.0, 0.5, 10)]
    return [
        RowParams.sanitised(t, p, k, torch.Generator().manual_seed(i), 3, vocab)
        for i, (t, p, k) in enumerate(settings)
    ]


def test_seeded_sampling_on_cuda_draws_the_cpus_tokens():
    torch.manual_seed(0)
    logits = torch.randn(5, 3000) * 3  # (B, V): more than two CDF blocks
    on_cpu = sample(logits, _rows(3000))
    on_gpu = sample(logits.cuda(), _rows(3000))
    assert on_gpu.tokens == on_cpu.tokens
    torch.testing.assert_close(torch.tensor(on_gpu.logprobs), torch.tensor(on_cpu.logprobs))


def test_a_bucketed_decode_on_cuda_computes_the_unpadded_logits():
    model = _model(torch.float32, "cuda")
    prompts = [[(5 + 3 * i + j) % 90 + 3 for i in range(BLOCK + 4 + 7 * j)] for j in range(3)]
    lengths = torch.tensor([len(p) for p in prompts])
    logits = {}
    for bucketed in (False, True):
        runner = PagedModelRunner(model, 4, 256, BLOCK, attention="flex")
        runner.prefill([0, 1, 2], prompts, [0, 0, 0])
        tokens = torch.tensor([7, 8, 9])
        step = runner.decode_in_bucket if bucketed else runner.decode
        logits[bucketed] = step(tokens, lengths, 8) if bucketed else step(tokens, lengths)
    torch.testing.assert_close(logits[True].cpu(), logits[False].cpu(), rtol=0, atol=1e-5)
