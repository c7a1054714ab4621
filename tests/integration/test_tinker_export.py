"""`asyncgrpo export` of a Tinker saved state: a model trained by `LoraModels` (the trainer
behind `tinker-serve`) on the tiny Llama, whose head is tied to its embedding and trained
(Tinker's default `train_unembed`), saved by `CheckpointStore` as the server saves it, then
exported through the CLI as a PEFT adapter and as a merged model, each loaded by peft /
transformers and compared on log-probs with the trainer's own forward (fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncgrpo.base.config import TrainerConfig
from asyncgrpo.cli import main as cli_main
from asyncgrpo.learning.trainer.datums import AdamParams
from asyncgrpo.tinker.checkpoints import CheckpointStore, tinker_path
from asyncgrpo.tinker.training import LORA_ALPHA, LoraModels
from asyncgrpo.tinker.wire import TinkerDatum

peft = pytest.importorskip("peft")

MODEL_ID = "s1:train:0"
TOLERANCE = 1e-5


def datum(seed: int, n: int = 12, vocab: int = 200) -> TinkerDatum:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n,), generator=g).numpy()
    targets = torch.randint(0, vocab, (n,), generator=g).numpy()
    return TinkerDatum(tokens, {"target_tokens": targets, "weights": np.ones(n, np.float32)})


def token_logprobs(model, d: TinkerDatum) -> np.ndarray:
    """Position i of the input predicts target i: an independent plain forward."""
    with torch.no_grad():
        logits = model(torch.as_tensor(d.tokens)[None]).logits[0].float()  # (N, V)
    targets = torch.as_tensor(d.inputs["target_tokens"])
    return logits.log_softmax(-1)[torch.arange(len(targets)), targets].numpy()


def load_base(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """(state dir, tinker path, the trainer's log-probs of a held-out datum) after three
    steps of cross_entropy on the default lora_config (attention, MLP and the tied head)."""
    models = LoraModels(load_base(tiny_model_dir), TrainerConfig(bf16_autocast=False))
    models.create(MODEL_ID, rank=4, seed=3)
    for _ in range(3):
        models.forward_backward(MODEL_ID, [datum(1), datum(2, n=7)], "cross_entropy")
        models.optim_step(MODEL_ID, AdamParams(learning_rate=2e-2))
    root = tmp_path_factory.mktemp("tinker-state")
    path = tinker_path(MODEL_ID, "weights", "step-3")
    CheckpointStore(root).save_state(path, models.state(MODEL_ID), str(tiny_model_dir))
    want = models.forward(MODEL_ID, [datum(9)], "cross_entropy").logprobs[0]
    return root, path, want


def test_the_trained_adapter_moves_the_tied_head_and_the_logprobs(saved, tiny_model_dir):
    root, path, want = saved
    tensors = load_file(CheckpointStore(root).directory(path) / "tensors.safetensors")
    head_b = [t for name, t in tensors.items() if name.endswith("lm_head.lora_B.weight")]
    assert len(head_b) == 1 and head_b[0].abs().max() > 1e-3  # the head adapter trained
    base = token_logprobs(load_base(tiny_model_dir), datum(9))
    assert np.abs(base - want).max() > 1e-3  # so the comparisons below can fail


def test_export_as_peft_adapter_gives_the_trainers_logprobs(saved, tiny_model_dir, tmp_path):
    root, path, want = saved
    out = tmp_path / "adapter"
    assert cli_main(["export", path, str(out), "--state-dir", str(root)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == LORA_ALPHA
    assert set(config["target_modules"]) == {
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "lm_head",
    }
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    saved_names = load_file(out / "adapter_model.safetensors")
    assert not any("optimizer" in n or "embed_tokens" in n for n in saved_names)
    model = peft.PeftModel.from_pretrained(load_base(config["base_model_name_or_path"]), out)
    np.testing.assert_allclose(
        token_logprobs(model.eval(), datum(9)), want, rtol=TOLERANCE, atol=TOLERANCE
    )


def test_merged_export_unties_the_head_and_gives_the_trainers_logprobs(
    saved, tiny_model_dir, tmp_path
):
    root, path, want = saved
    out = tmp_path / "merged"
    checkpoint_dir = CheckpointStore(root).directory(path)
    assert cli_main(["export", str(checkpoint_dir), str(out), "--merged"]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    merged, base = load_base(out), load_base(tiny_model_dir)
    embedding = merged.get_input_embeddings().weight
    assert merged.get_output_embeddings().weight.data_ptr() != embedding.data_ptr()
    assert torch.equal(embedding, base.get_input_embeddings().weight)  # the embedding kept
    np.testing.assert_allclose(
        token_logprobs(merged, datum(9)), want, rtol=TOLERANCE, atol=TOLERANCE
    )


def test_tinker_sources_that_cannot_be_exported_fail_with_one_line(saved, tmp_path, capsys):
    root, path, _ = saved
    out = str(tmp_path / "out")
    assert cli_main(["export", path, out]) == 2
    assert "--state-dir" in capsys.readouterr().err
    sampler = tinker_path(MODEL_ID, "sampler_weights", "s")
    assert cli_main(["export", sampler, out, "--state-dir", str(root)]) == 2
    assert "sampler checkpoint" in capsys.readouterr().err
    missing = tinker_path(MODEL_ID, "weights", "nope")
    assert cli_main(["export", missing, out, "--state-dir", str(root)]) == 2
    assert "nothing is saved" in capsys.readouterr().err
    assert cli_main(["export", path, out, "--state-dir", str(root), "--step", "3"]) == 2
    assert "--step" in capsys.readouterr().err
