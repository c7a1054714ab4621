"""The KL penalty to the reference policy (`loss.beta > 0`) against plain-loop references.

Every expected value is recomputed here one unpacked sequence at a time, with a
plain Hugging Face forward in float64 on fresh copies of the weights (default
attention, no packing), `log_softmax` at the sampling temperature and a gather;
k3 = exp(ref − lp) − (ref − lp) − 1 per token. None of it calls the code under test.
"""

import copy
import math

import pytest
import torch

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig, load_config
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
from asyncgrpo.learning.trainer.reference import make_reference
from asyncgrpo.testing import build_tiny_llama

VOCAB, SEED, TEMPERATURE = 64, 3, 0.7


# ---- the plain-loop reference -----------------------------------------------------------


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in a newly built model with default attention, in float64."""
    twin = build_tiny_llama(VOCAB, seed=SEED)
    twin.load_state_dict(model.state_dict())
    return twin.double().eval()


def loop_logprobs(model, seq: list[int], prompt_len: int) -> list[float]:
    """log π(token) of each completion token of one unpacked sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()  # (L, V)
    logp = torch.log_softmax(logits[prompt_len - 1 : -1] / TEMPERATURE, dim=-1)  # (C, V)
    return logp.gather(1, torch.tensor(seq[prompt_len:])[:, None]).squeeze(1).tolist()


def loop_k3_mean(policy, reference, rollouts: list[Rollout]) -> float:
    """Mean of k3 over the tokens that carry loss (completion_mask 1)."""
    total, count = 0.0, 0
    for r in rollouts:
        seq = r.prompt_ids + r.completion_ids
        lps = loop_logprobs(policy, seq, len(r.prompt_ids))
        refs = loop_logprobs(reference, seq, len(r.prompt_ids))
        for t, (lp, ref) in enumerate(zip(lps, refs, strict=True)):
            if r.completion_mask is None or r.completion_mask[t]:
                x = ref - lp
                total += math.exp(x) - x - 1
                count += 1
    return total / count


# ---- batches ------------------------------------------------------------------------------


def rollout(prompt, completion, reward, mask=None) -> Rollout:
    n = len(completion)
    return Rollout(prompt, completion, [-4.0] * n, [0] * n, "stop", "", [reward], mask)


def batch(rewards: tuple[float, float, float, float]) -> list[Group]:
    """Two groups with different prompts; one sample has an inserted (mask 0) token."""
    a, b, c, d = rewards
    return [
        Group(
            0,
            {},
            [
                rollout([1, 2, 3], [10, 11, 12, 13], a),
                rollout([1, 2, 3], [14, 15, 16, 17, 18], b, mask=[1, 1, 0, 1, 1]),
            ],
        ),
        Group(1, {}, [rollout([7, 8], [20, 21, 22], c), rollout([7, 8], [23, 24] * 3, d)]),
    ]


def all_rollouts(groups: list[Group]) -> list[Rollout]:
    return [r for g in groups for r in g.rollouts]


def make_trainer(model, beta: float, **trainer_options) -> PolicyTrainer:
    options = dict(bf16_autocast=False, micro_batch_tokens=16) | trainer_options
    return PolicyTrainer(
        model,
        TrainerConfig(**options),
        LossConfig(beta=beta),
        AdvantageConfig(),
        max_steps=10,
        temperature=TEMPERATURE,
    )


# ---- 1. the logged KL is the hand-computed k3 ---------------------------------------------


@pytest.mark.parametrize("bf16", [False, True])
def test_kl_is_exactly_zero_while_the_policy_is_the_reference(bf16):
    trainer = make_trainer(build_tiny_llama(VOCAB, seed=SEED), beta=0.1, bf16_autocast=bf16)
    metrics = trainer.step(batch((1.0, 0.0, 0.0, 1.0)))
    assert metrics["kl"] == 0.0  # also under autocast: the reference runs under it too


def test_logged_kl_matches_a_hand_computed_k3_after_a_step():
    model = build_tiny_llama(VOCAB, seed=SEED)
    initial = fresh_copy(model)
    trainer = make_trainer(model, beta=0.1, learning_rate=1e-2)
    trainer.step(batch((1.0, 0.0, 0.0, 1.0)))

    fixed = batch((0.3, 0.9, 0.5, 0.1))
    expected = loop_k3_mean(fresh_copy(model), initial, all_rollouts(fixed))
    metrics = trainer.step(fixed)  # the KL is logged before this step's update
    assert expected > 1e-3  # the first step moved the policy away from the reference
    assert metrics["kl"] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_the_frozen_copy_is_a_separate_untrained_model():
    model = build_tiny_llama(VOCAB, seed=SEED)
    trainer = make_trainer(model, beta=0.1)
    reference = trainer.reference.model
    policy_storage = {p.data_ptr() for p in model.parameters()}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not reference.training and model.training
    for p in reference.parameters():
        assert not p.requires_grad and p.data_ptr() not in policy_storage
        assert id(p) not in optimized
    assert make_trainer(build_tiny_llama(VOCAB, seed=SEED), beta=0.0).reference is None


# ---- 2. the gradient holds β·∇k3 ----------------------------------------------------------


def perturbed_trainer(beta: float) -> tuple[PolicyTrainer, torch.nn.Module]:
    """A trainer whose policy was moved off its reference in place after construction."""
    model = build_tiny_llama(VOCAB, seed=SEED)
    trainer = make_trainer(model, beta=beta, learning_rate=1e-3, max_grad_norm=1e6)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    return trainer, model


def hand_kl_gradient(policy, reference, rollouts, beta) -> dict[str, torch.Tensor]:
    """∇θ of β · mean k3 over loss tokens (dapo with zero advantages), per parameter."""
    policy.zero_grad()
    terms = []
    for r in rollouts:
        seq = r.prompt_ids + r.completion_ids
        p = len(r.prompt_ids)
        refs = torch.tensor(loop_logprobs(reference, seq, p), dtype=torch.float64)
        logits = policy(torch.tensor([seq])).logits[0]  # (L, V) float64
        logp = torch.log_softmax(logits[p - 1 : -1] / TEMPERATURE, dim=-1)
        lp = logp.gather(1, torch.tensor(r.completion_ids)[:, None]).squeeze(1)  # (C,)
        keep = torch.tensor(r.completion_mask or [1] * len(lp), dtype=torch.bool)
        x = (refs - lp)[keep]
        terms.append(torch.exp(x) - x - 1)
    (beta * torch.cat(terms).mean()).backward()
    return {name: p.grad.float() for name, p in policy.named_parameters()}


def test_with_zero_advantages_the_step_follows_the_kl_gradient_alone():
    beta, lr = 0.5, 1e-3
    trainer, model = perturbed_trainer(beta)
    initial = fresh_copy(build_tiny_llama(VOCAB, seed=SEED))
    groups = batch((1.0, 1.0, 0.0, 0.0))  # equal rewards in each group: all advantages 0
    rollouts = all_rollouts(groups)
    kl_before = loop_k3_mean(fresh_copy(model), initial, rollouts)
    grads = hand_kl_gradient(fresh_copy(model), initial, rollouts, beta)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    metrics = trainer.step(groups)
    assert metrics["advantage_abs_mean"] == 0.0
    # with zero advantages the loss is the KL term alone: β · mean k3
    assert metrics["loss"] == pytest.approx(beta * kl_before, rel=1e-5)
    # AdamW's first step is -lr · g / (|g| + eps): a step of lr against the sign of g
    checked = 0
    for name, p in model.named_parameters():
        g = grads[name]
        clear = g.abs() > 1e-3 * g.abs().max()  # below, float32 noise can flip a sign
        step = (p.detach() - before[name])[clear]
        assert torch.allclose(step, -lr * g[clear].sign(), rtol=0, atol=lr * 1e-2), name
        checked += int(clear.sum())
    assert checked > 0.95 * sum(p.numel() for p in model.parameters())
    assert loop_k3_mean(fresh_copy(model), initial, rollouts) < kl_before  # towards the reference


def test_without_beta_zero_advantages_leave_the_weights_untouched():
    trainer, model = perturbed_trainer(beta=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.step(batch((1.0, 1.0, 0.0, 0.0)))
    assert "kl" not in metrics
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# ---- 3. LoRA: the base model with the adapter disabled, no copy ----------------------------


def test_lora_reference_is_the_base_model_and_shares_its_weights():
    peft = pytest.importorskip("peft")
    base = fresh_copy(build_tiny_llama(VOCAB, seed=SEED))  # an unwrapped copy of the base
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build_tiny_llama(VOCAB, seed=SEED), lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0, which would make the adapter a no-op
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
    adapted = copy.deepcopy(model).merge_and_unload()
    adapted = fresh_copy(adapted)
    tensors_before = {p.data_ptr() for p in model.parameters()}
    count_before = len(list(model.parameters()))

    reference = make_reference(model)
    # no second model: every tensor the reference forwards is one of the policy's
    assert {p.data_ptr() for p in reference.model.parameters()} <= tensors_before
    assert len(list(model.parameters())) == count_before

    from asyncgrpo.learning.trainer.packing import enable_packed_attention

    enable_packed_attention(reference.model)
    rollouts = all_rollouts(batch((0.0, 0.0, 0.0, 0.0)))
    sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
    prompt_lengths = [len(r.prompt_ids) for r in rollouts]
    got = reference.logprobs(sequences, prompt_lengths, TEMPERATURE)
    for r, seq, values in zip(rollouts, sequences, got, strict=True):
        p = len(r.prompt_ids)
        want_base = torch.tensor(loop_logprobs(base, seq, p), dtype=torch.float32)
        want_adapted = torch.tensor(loop_logprobs(adapted, seq, p), dtype=torch.float32)
        assert torch.allclose(values, want_base, atol=1e-5)
        assert (values - want_adapted).abs().max() > 1e-2  # the adapter matters
    # the adapter is back on after the reference forward
    policy = torch.tensor(loop_logprobs(model, sequences[0], prompt_lengths[0]))
    merged = torch.tensor(loop_logprobs(adapted, sequences[0], prompt_lengths[0]))
    assert torch.allclose(policy, merged, atol=1e-5)


def test_a_kl_penalty_loads_from_a_recipe():
    assert load_config(None, ["loss.beta=0.1"]).loss.beta == 0.1
