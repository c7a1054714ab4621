"""`asyncgrpo train --resume` of a LoRA run: the checkpoint holds the adapter alone, and
the resumed run is the uninterrupted one.

Two runs with the same seed at `max_staleness: 0` (synchronous, per-group seeded
sampling, hence deterministic): one stops at step 2 and is resumed to step 4, the other
runs 4 steps straight. The resumed run must then sample the same completions and end
with the same adapter; its engine, a fresh process on the base model, must decode
after the first sync as base + the checkpoint's adapter merged by peft does.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_export import GREEDY_TOKENS, PROMPTS, RUN_LORA, adapter_bytes, greedy
from test_train import read_jsonl, train_rows, write_recipe
from transformers import AutoModelForCausalLM

from asyncgrpo.cli import main as cli_main
from asyncgrpo.run.session.engine_link import EngineLink

peft = pytest.importorskip("peft")


def lora_run(tmp_path: Path, base_dir: Path, name: str, max_steps: int) -> Path:
    recipe = write_recipe(
        tmp_path,
        base_dir,
        name,
        max_steps=max_steps,
        checkpoint_steps=1,
        **{"trainer.learning_rate": 2e-2, "model.lora": RUN_LORA},
    )
    assert cli_main(["train", str(recipe)]) == 0
    return tmp_path / name


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def tensor_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensor data (the file less its header)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header_len


def peft_model(base_dir: Path):
    """The tiny model wrapped by peft itself with the run's LoRA recipe (fresh adapter)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=RUN_LORA["r"], lora_alpha=RUN_LORA["alpha"], target_modules=RUN_LORA["target_modules"]
    )
    return peft.get_peft_model(base, config)


def engine_greedy_after_first_sync(monkeypatch) -> dict:
    """The engine's weight version and greedy continuations (ids, log-probs) of `PROMPTS`,
    asked right after the session's first sync, before any group is sampled."""
    served: dict = {}
    original = EngineLink.sync_weights

    def sync_weights(r: EngineLink) -> None:
        original(r)
        if served:
            return
        r.settle()  # the sync lands in the background: ask once it has

        async def ask() -> None:
            served["version"] = await r.engine.client.weight_version()
            served["samples"] = []
            for prompt in PROMPTS:
                done = await r.engine.client.complete(
                    prompt, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True
                )
                served["samples"].append((done.samples[0].token_ids, done.samples[0].logprobs))

        r.loop.run(ask(), timeout=60)

    monkeypatch.setattr(EngineLink, "sync_weights", sync_weights)
    return served


def sampled(run_dir: Path) -> list[tuple]:
    """(step, group id, data index, completions) of each trained group, by step and group
    id: within a step, groups reach the batch in the order they finish, which varies."""
    return sorted(
        (s["step"], s["group_id"], [c["completion"] for c in s["samples"]])
        for s in read_jsonl(run_dir / "samples.jsonl")
    )


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], -1)
    return torch.tensor([logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)])


@pytest.mark.heavy
def test_lora_checkpoint_is_the_adapter_and_resume_continues_the_run(
    tmp_path, tiny_model_dir, monkeypatch
):
    base_dir = Path(tiny_model_dir)
    resumed = lora_run(tmp_path, base_dir, "resumed", max_steps=2)
    straight = lora_run(tmp_path, base_dir, "straight", max_steps=4)

    # the step-2 checkpoint: adapter tensors alone, of the size the recipe and shapes give
    step2 = checkpoint(resumed, 2)
    adapter = load_file(step2 / "model.safetensors")
    fresh = peft_model(base_dir)
    trained = [(n, p.shape) for n, p in fresh.named_parameters() if p.requires_grad]
    assert sorted(adapter) == sorted(n for n, _ in trained)
    assert all("lora_" in name for name in adapter)
    expected = adapter_bytes(base_dir, RUN_LORA, torch.float32.itemsize)
    assert tensor_bytes(step2 / "model.safetensors") == expected
    assert expected * 50 < tensor_bytes(base_dir / "model.safetensors")
    # its optimizer state: Adam's moments of the adapter's parameters, nothing else
    state = json.loads((step2 / "state.json").read_text())
    assert (state["step"], state["version"]) == (2, 2)
    assert state["optimizer"]["param_groups"][0]["params"] == list(range(len(trained)))
    moments = load_file(step2 / "optimizer.safetensors")
    for i, (_, shape) in enumerate(trained):
        assert moments[f"{i}.exp_avg"].shape == moments[f"{i}.exp_avg_sq"].shape == shape
    assert sum(v.numel() for k, v in moments.items() if k.endswith(".exp_avg")) * 4 == expected
    indices = {int(k.split(".")[0]) for k in moments if not k.startswith("rng.")}
    assert indices == set(range(len(trained)))

    served = engine_greedy_after_first_sync(monkeypatch)
    argv = ["train", "--resume", str(resumed), "--set", "max_steps=4"]
    assert cli_main(argv) == 0
    rows = train_rows(resumed)
    assert [(r["step"], r["version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]

    # the resumed engine (base model) after its first sync decodes as base + step-2 adapter
    fresh.load_state_dict(adapter, strict=False)
    merged = fresh.merge_and_unload().eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    assert served["version"] == 2
    for prompt, (tokens, logprobs) in zip(PROMPTS, served["samples"], strict=True):
        assert greedy(merged, prompt) == tokens
        reference = logprobs_of(merged, prompt, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), reference, atol=1e-4, rtol=0)
        # the adapter moves the log-probs: base weights alone would fail the check above
        assert (logprobs_of(base, prompt, tokens) - reference).abs().max() > 1e-3

    # training went on from the checkpoint, exactly as the uninterrupted run did
    final = load_file(checkpoint(resumed, 4) / "model.safetensors")
    assert all((final[k] - adapter[k]).abs().max() > 1e-4 for k in adapter)
    straight_final = load_file(checkpoint(straight, 4) / "model.safetensors")
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, straight_final[name], atol=1e-6, rtol=0)
    assert sampled(resumed) == sampled(straight)  # group ids, rows and completions
