"""`asyncgrpo export`: run directories written by the real checkpoint code, exported, then
loaded by transformers, peft and the embedded engine's loader, and compared on logits with
the model that was trained. One test trains for real: `asyncgrpo train` with `model.lora`,
its adapter-only syncs counted on the wire, its merged export decoded greedily by
transformers against the run's own engine at the last step."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_train import train_rows, write_recipe
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.base.config import RunConfig
from asyncgrpo.cli import main as cli_main
from asyncgrpo.inference.backend.embedded import EmbeddedBackend
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.engine.loading import load_model as engine_load_model
from asyncgrpo.learning.trainer.checkpoint import Checkpointer, TrainingState, save_checkpoint
from asyncgrpo.learning.trainer.lora import apply_lora, published_weights
from asyncgrpo.run.export import export_run

peft = pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 12.0, "target_modules": ["q_proj", "v_proj", "o_proj"]}
TOKENS = torch.tensor([[1, 17, 42, 99, 5, 230, 7, 64, 300, 12]])


class TrainedRun:
    """A run directory and its live model, written the way a run writes them: checkpoints
    by `save_checkpoint` (under LoRA: the adapter alone), weight snapshots by `Checkpointer`
    from the published weights."""

    def __init__(self, run_dir: Path, base_dir: Path, lora: dict | None):
        self.run_dir = run_dir
        cfg = RunConfig(model={"name_or_path": str(base_dir), "lora": lora})
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        self.model = apply_lora(model, cfg.model.lora) if lora else model
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained)
        self.version = 0
        self.checkpoints = Checkpointer(self, run_dir, 1, 1, torch.float32)

    def train_to(self, step: int, seed: int) -> None:
        """Move every trained parameter (LoRA: B too, which starts at zero), checkpoint."""
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in self.trained:
                param.add_(torch.randn_like(param) * 0.05)
        self.version = step
        self.checkpoints.maybe_save(step, lambda: ({}, {}), 0.0)
        self.checkpoints.wait()

    def named_weights(self, dtype=None):
        return published_weights(self.model, dtype)

    def save_checkpoint(self, directory: Path, state: TrainingState) -> Path:
        return save_checkpoint(directory, self.model, self.optimizer, None, state)

    def logits(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(TOKENS).logits


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


@pytest.fixture
def base_dir(tiny_model_dir):
    return Path(tiny_model_dir)


def test_full_run_exports_a_model_transformers_and_the_engine_load(tmp_path, base_dir):
    run = TrainedRun(tmp_path / "run", base_dir, lora=None)
    run.train_to(3, seed=1)
    out = tmp_path / "out"
    message = export_run(run.run_dir, out)
    assert "step 3" in message
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits_of(loaded), run.logits(), atol=1e-5, rtol=0)
    assert not torch.allclose(logits_of(loaded), logits_of(_base(base_dir)), atol=1e-3)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    tokenizer, engine_model = engine_load_model(str(out), torch.float32, torch.float32)
    torch.testing.assert_close(logits_of(engine_model), run.logits(), atol=1e-5, rtol=0)
    original = AutoTokenizer.from_pretrained(base_dir)
    text = "What is 12 + 7? The answer is 19."
    assert tokenizer.encode(text) == original.encode(text)
    assert (out / "generation_config.json").is_file()


def test_lora_run_exports_an_adapter_and_a_merged_model(tmp_path, base_dir):
    run = TrainedRun(tmp_path / "run", base_dir, lora=LORA)
    run.train_to(2, seed=2)
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    export_run(run.run_dir, adapter_dir)
    export_run(run.run_dir, merged_dir, merged=True)
    assert (adapter_dir / "adapter_config.json").is_file()
    assert not (adapter_dir / "model.safetensors").exists()
    adapted = peft.PeftModel.from_pretrained(_base(base_dir), adapter_dir)
    torch.testing.assert_close(logits_of(adapted), run.logits(), atol=1e-5, rtol=0)
    # the adapter names its base, so peft's auto class finds it alone
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32)
    torch.testing.assert_close(logits_of(auto), run.logits(), atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    torch.testing.assert_close(logits_of(merged), run.logits(), atol=1e-5, rtol=0)
    assert not torch.allclose(logits_of(merged), logits_of(_base(base_dir)), atol=1e-3)
    _, engine_model = engine_load_model(str(merged_dir), torch.float32, torch.float32)
    torch.testing.assert_close(logits_of(engine_model), run.logits(), atol=1e-5, rtol=0)


def test_step_picks_a_checkpoint_or_a_weights_snapshot(tmp_path, base_dir):
    run = TrainedRun(tmp_path / "run", base_dir, lora=LORA)
    expected = {}
    for step in (1, 2, 3):
        run.train_to(step, seed=10 + step)
        expected[step] = run.logits()
    # checkpoints keep the newest 2 (steps 2, 3); step 1 survives as a weights snapshot,
    # under published names with alpha/r baked into lora_B
    assert not (run.run_dir / "checkpoints" / "step-000001").exists()
    assert (run.run_dir / "weights" / "step-000001.safetensors").is_file()
    for step, merged in ((1, False), (1, True), (2, True), (None, True)):
        out = tmp_path / f"out-{step}-{merged}"
        export_run(run.run_dir, out, step=step, merged=merged)
        model = (
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            if merged
            else peft.PeftModel.from_pretrained(_base(base_dir), out)
        )
        torch.testing.assert_close(logits_of(model), expected[step or 3], atol=1e-5, rtol=0)


def _base(base_dir: Path):
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def cli_error(capsys, *argv: str) -> str:
    """Run `asyncgrpo export ...` in-process; expects exit 2 and one line on stderr."""
    capsys.readouterr()  # drop what building the run printed
    assert cli_main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_cli_errors_are_one_line(tmp_path, base_dir, capsys):
    assert "not a run directory" in cli_error(capsys, str(tmp_path), str(tmp_path / "o"))
    run = TrainedRun(tmp_path / "run", base_dir, lora=None)
    assert "no checkpoint" in cli_error(capsys, str(run.run_dir), str(tmp_path / "o"))
    run.train_to(5, seed=0)
    run.train_to(7, seed=0)
    err = cli_error(capsys, str(run.run_dir), str(tmp_path / "o"), "--step", "6")
    assert "step 6" in err and "available: 5, 7" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_text("x")
    assert "not an empty directory" in cli_error(capsys, str(run.run_dir), str(busy))
    assert not (tmp_path / "o").exists()


@pytest.mark.heavy
def test_cli_exports_into_an_empty_directory(tmp_path, base_dir):
    """The installed entry point, in its own process: a success, then a user error."""
    run = TrainedRun(tmp_path / "run", base_dir, lora=LORA)
    run.train_to(1, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "asyncgrpo.cli", "export", str(run.run_dir), str(out)]
    done = subprocess.run([*command, "--merged"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "step 1 merged model" in done.stdout
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits_of(merged), run.logits(), atol=1e-5, rtol=0)
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert again.stderr.strip().startswith("error: ") and "Traceback" not in again.stderr


def test_save_model_into_the_output_dir_as_trl_users_do(tmp_path, base_dir):
    """`trainer.save_model(args.output_dir)`: the model files land beside the run
    directories (a second save replaces them) and `from_pretrained(output_dir)` loads."""
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    run = TrainedRun(tmp_path / "run", base_dir, lora=None)
    run.train_to(2, seed=1)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), name="run")
    trainer = AsyncGRPOTrainer(model=str(base_dir), reward_funcs=[len], args=args)
    trainer.run_dir = run.run_dir  # as train() leaves it
    for _ in range(2):
        assert trainer.save_model(str(tmp_path)) == tmp_path
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(logits_of(loaded), run.logits(), atol=1e-5, rtol=0)
    assert (tmp_path / "run" / "checkpoints").is_dir()  # the run itself is untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tmp")) == []


# ---- `asyncgrpo train` with LoRA: sync bytes, merged export against the run's engine ----

RUN_LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
PROMPTS = [
    [1, 17, 42, 99, 5],
    [230, 7, 64, 300, 12, 3, 88],
    [2, 150, 9, 77],
    [400, 31, 260, 5, 118],
]
GREEDY_TOKENS = 12


def adapter_bytes(model_dir: Path, lora: dict, itemsize: int) -> int:
    """Bytes of the adapter from the model's config alone: A (r, in) and B (out, r) for
    each targeted projection of each layer."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    in_out = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    per_layer = sum(lora["r"] * sum(in_out[t]) for t in lora["target_modules"])
    return c["num_hidden_layers"] * per_layer * itemsize


def record_http_bodies(monkeypatch) -> list[bytes]:
    """Each `/update_weights` body the engine accepted (http transport), as streamed."""
    bodies: list[bytes] = []
    original = EngineClient.update_weights_bytes

    async def update_weights_bytes(client, body, size):
        streamed = bytearray()

        async def counted():
            streamed.clear()  # a retried request streams the body again
            async for piece in body():
                streamed.extend(piece)
                yield piece

        await original(client, counted, size)
        bodies.append(bytes(streamed))

    monkeypatch.setattr(EngineClient, "update_weights_bytes", update_weights_bytes)
    return bodies


def greedy_before_close(monkeypatch) -> dict:
    """Ask the run's engine, just before the run stops it, for its weight version and a
    greedy continuation (token ids, log-probs) of each of `PROMPTS`."""
    served: dict = {"samples": []}
    original = EmbeddedBackend.close

    async def close(backend):
        served["version"] = await backend.client.weight_version()
        for prompt in PROMPTS:
            done = await backend.client.complete(
                prompt, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True
            )
            sample = done.samples[0]
            served["samples"].append((sample.token_ids, sample.logprobs))
        await original(backend)

    monkeypatch.setattr(EmbeddedBackend, "close", close)
    return served


@pytest.mark.heavy
def test_lora_train_syncs_the_adapter_and_exports_what_the_engine_served(
    tmp_path, base_dir, monkeypatch
):
    """`asyncgrpo train` with `model.lora`, fp32 engine, http weight transport: every sync
    body holds the adapter and nothing else; `asyncgrpo export --merged` of the last step
    decodes greedily (transformers) exactly as the run's engine did at that step, asked
    just before the run stopped it."""
    bodies = record_http_bodies(monkeypatch)
    served = greedy_before_close(monkeypatch)
    recipe = write_recipe(
        tmp_path,
        base_dir,
        "lora-run",
        max_steps=3,
        checkpoint_steps=1,
        **{
            "trainer.learning_rate": 2e-2,
            "model.lora": RUN_LORA,
            "engine.weight_transport": "http",
        },
    )
    assert cli_main(["train", str(recipe)]) == 0
    run_dir = tmp_path / "lora-run"
    assert [row["version"] for row in train_rows(run_dir)] == [1, 2, 3]

    # one body per sync (the initial one, then after each step), each the adapter alone
    expected = adapter_bytes(base_dir, RUN_LORA, torch.float32.itemsize)
    assert len(bodies) == 4
    for body in bodies:
        (header_len,) = struct.unpack("<Q", body[:8])
        header = json.loads(body[8 : 8 + header_len])
        header.pop("__metadata__", None)
        assert all(".lora_" in name and t["dtype"] == "F32" for name, t in header.items())
        assert len(body) - 8 - header_len == expected

    out = tmp_path / "merged"
    assert cli_main(["export", str(run_dir), str(out), "--step", "3", "--merged"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = _base(base_dir).state_dict()
    for name, weight in merged.state_dict().items():  # trained: targets moved, nothing else
        moved = (weight - base[name]).abs().max().item()
        targeted = any(f".{t}." in name for t in RUN_LORA["target_modules"])
        assert moved > 1e-4 if targeted else moved == 0, (name, moved)

    assert served["version"] == 3
    base_model = _base(base_dir)
    for prompt, (tokens, logprobs) in zip(PROMPTS, served["samples"], strict=True):
        assert greedy(merged, prompt) == tokens
        with torch.no_grad():
            logp = torch.log_softmax(merged(torch.tensor([prompt + tokens])).logits[0], -1)
        reference = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(reference), atol=1e-4, rtol=0
        )
    # the adapter changes what is decoded, so equal tokens are not the base's by default
    assert any(
        greedy(base_model, p) != tokens for p, (tokens, _) in zip(PROMPTS, served["samples"])
    )


def greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy decoding of `GREEDY_TOKENS` tokens, never stopping at eos."""
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=GREEDY_TOKENS,
            eos_token_id=None,  # as the engine's ignore_eos: never stop, never mask
        )
    return ids[0, len(prompt) :].tolist()
