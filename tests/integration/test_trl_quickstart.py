"""TRL's quickstart, ported by renaming the two classes, runs unchanged on SmolLM2 (the
script as TRL publishes it, its default num_generations included), its export is the last
checkpoint's trained policy, and it loads in transformers with the engine's own greedy
output (fp32)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a cat", "rain", "trains", "bread", "winter", "music", "a garden"]


def reward_len(completions, **kwargs):
    """TRL's quickstart reward: completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def test_a_trl_style_script_runs_and_its_export_matches_the_engine(tmp_path):
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.base.models import resolve_model

    ds = Dataset.from_list([{"prompt": f"Write one line about {t}."} for t in TOPICS * 4])
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_completion_length=24,
        per_device_train_batch_size=8,
        loss_type="dr_grpo",
        save_steps=3,
        logging_steps=1,
        learning_rate=1e-5,
        max_steps=3,
    )
    trainer = AsyncGRPOTrainer(
        model="smollm2-135m", reward_funcs=reward_len, train_dataset=ds, args=args
    )
    run_dir = trainer.train()
    out = tmp_path / "exported"
    trainer.save_model(str(out))

    # the export is the last checkpoint's policy, which training moved from the base model
    exported = load_file(out / "model.safetensors")
    trained = load_file(run_dir / "checkpoints" / "step-000003" / "model.safetensors")
    base = load_file(resolve_model("smollm2-135m") / "model.safetensors")
    assert trained.keys() <= exported.keys() and trained.keys() <= base.keys()
    for name, tensor in trained.items():
        assert torch.equal(exported[name].float(), tensor.float()), name
    assert any(not torch.equal(base[n].float(), t.float()) for n, t in trained.items())

    tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Write one line about the sea."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
    hf = hf[0, len(prompt) :].tolist()
    assert len(hf) >= 8  # an answer, not an immediate end of turn
    assert engine_greedy(out, prompt, 16) == hf


def engine_greedy(model_dir, prompt: list[int], tokens: int) -> list[int]:
    """The embedded engine's greedy tokens for `prompt`, in fp32."""
    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.inference.backend.embedded import EmbeddedBackend

    async def run() -> list[int]:
        backend = EmbeddedBackend(EmbeddedEngineConfig(model=str(model_dir), dtype="float32"))
        try:
            await backend.wait_ready()
            result = await backend.client.complete(prompt, max_tokens=tokens, temperature=0)
            return list(result.samples[0].token_ids)
        finally:
            await backend.close()

    return asyncio.run(run())
