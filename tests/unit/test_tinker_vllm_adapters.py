"""`tinker-serve --engine vllm` without a vLLM server: the adapter names and their unloading
(`tinker.vllm_adapters`), the requests and loads `VLLMAdapters` sends through a stub of the
vLLM client, the peft directory written from a trained model's sampler weights, which
peft must load into the same model the trainer computes with, and the command line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncgrpo.base.config import TrainerConfig
from asyncgrpo.base.engine_errors import EngineRefused
from asyncgrpo.inference.client.engine_client import Completion, Continuation
from asyncgrpo.inference.vllm.launcher import VLLMServer
from asyncgrpo.learning.trainer.datums import AdamParams
from asyncgrpo.testing import build_tiny_llama
from asyncgrpo.tinker import serve
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.sample_wire import SampleCall
from asyncgrpo.tinker.sampling import Sampler, SamplerRegistry
from asyncgrpo.tinker.sampling_ops import key_in_use
from asyncgrpo.tinker.training import LoraModels
from asyncgrpo.tinker.vllm_adapters import BASE_KEY, AdapterBook
from asyncgrpo.tinker.vllm_sampling import VLLMAdapters, write_peft_adapter
from asyncgrpo.tinker.wire import TinkerDatum

VOCAB = 48


def always(key) -> bool:
    return True


# ---- the bookkeeping ---------------------------------------------------------------


def test_each_set_of_weights_gets_a_name_never_used_before(tmp_path):
    book = AdapterBook(tmp_path, prefix="p")
    first = book.new(("sampler", "s:sample:0"))
    book.added(first)
    book.unloaded(first)
    again = book.new(("sampler", "s:sample:0"))  # the same key, loaded once more
    other = book.new(("model", "s:train:0", 3))
    assert [first.name, again.name, other.name] == ["p-1", "p-2", "p-3"]
    assert first.path == tmp_path / "p-1"
    assert AdapterBook(tmp_path).prefix != AdapterBook(tmp_path).prefix  # one per process


def test_unused_adapters_go_first_then_the_least_recently_used_idle_ones(tmp_path):
    book = AdapterBook(tmp_path)
    a, b, c = (book.new(("sampler", name)) for name in "abc")
    for adapter in (a, b, c):
        book.added(adapter)
    book.started(a)  # a runs a request; c was used after b
    book.started(c)
    book.finished(c)
    assert book.to_unload(always, capacity=4) == []  # room for one more
    assert book.to_unload(always, capacity=3) == [b]  # the least recently used idle one
    assert book.to_unload(always, capacity=2) == [b, c]
    assert book.to_unload(always, capacity=1) == [b, c]  # a is busy: loaded anyway
    ended = {("sampler", "c")}
    assert book.to_unload(lambda key: key not in ended, capacity=10) == [c]
    assert book.to_unload(lambda key: key not in ended, capacity=3) == [c]
    assert book.to_unload(lambda key: key != ("sampler", "a"), capacity=10) == [a]


def test_an_unloaded_adapter_keeps_its_files_while_a_request_runs_on_it(tmp_path):
    book = AdapterBook(tmp_path)
    adapter = book.new(("model", "m", 0))
    book.added(adapter)
    book.started(adapter)
    book.unloaded(adapter)
    assert book.find(("model", "m", 0)) is None and book.deletable() == []
    book.finished(adapter)
    assert book.deletable() == [adapter] and book.deletable() == []


def test_a_key_is_in_use_while_its_sampler_lives_or_its_version_is_the_newest():
    samplers = SamplerRegistry()
    samplers.add(Sampler("s:sample:0", "base", weights=None))
    svc = SimpleNamespace(samplers=samplers, latest={"s:train:0": (2, None)})
    assert key_in_use(svc, ("sampler", "s:sample:0"))
    assert not key_in_use(svc, ("sampler", "s:sample:1"))  # its session ended
    assert key_in_use(svc, ("model", "s:train:0", 2))
    assert not key_in_use(svc, ("model", "s:train:0", 1))  # superseded
    assert not key_in_use(svc, ("model", "s:train:9", 0))  # the model is gone
    assert key_in_use(svc, BASE_KEY)


# ---- the requests, through a stub of the vLLM client ---------------------------------


class StubVLLMClient:
    """What `VLLMAdapters` calls on `VLLMClient`, recorded; adapters it holds by name."""

    def __init__(self, send_seed: bool = False, max_cpu_loras: int = 2, max_lora_rank: int = 8):
        self.send_seed = send_seed
        self.lora_config = {"max_cpu_loras": max_cpu_loras, "max_lora_rank": max_lora_rank}
        self.held: dict[str, str] = {}
        self.calls: list[tuple] = []
        self.refuse: EngineRefused | None = None

    async def vllm_config(self) -> dict:
        return {"lora_config": self.lora_config}

    async def register_lora_adapter(self, name: str, path: str) -> None:
        assert json.loads((Path(path) / "adapter_config.json").read_text())["r"] == 4
        await asyncio.sleep(0.01)  # a load takes a while: requests arriving meanwhile wait
        self.calls.append(("load", name))
        self.held[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        del self.held[name]

    async def complete(self, prompt_ids, *, model=None, **settings) -> Completion:
        self.calls.append(("complete", model, settings.get("seed")))
        if self.refuse is not None:
            refusal, self.refuse = self.refuse, None
            raise refusal
        if model is not None and model not in self.held:
            raise EngineRefused(404, f"The model `{model}` does not exist.")
        sample = Continuation([1, 2], [-0.5, -0.25], [0, 0], "length")
        return Completion([sample], list(prompt_ids))


def adapter_weights(seed: int, rank: int = 4) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    return [
        (module + ".lora_A.weight", torch.randn(rank, 16, generator=generator)),
        (module + ".lora_B.weight", torch.randn(16, rank, generator=generator)),
    ]


def sample_call(seed: int | None = None) -> SampleCall:
    return SampleCall(
        "s:sample:0", 1, 1, np.array([3, 4, 5]), 2, seed, None, 1.0, -1, 1.0, False, 0, None
    )


def names_loaded(client: StubVLLMClient) -> list[str]:
    return [call[1] for call in client.calls if call[0] == "load"]


def test_samplers_ask_for_their_own_adapters_loaded_once(tmp_path):
    client = StubVLLMClient()
    engine = VLLMAdapters(client, tmp_path)
    snapshot = ("sampler", "s:weights:step1")

    async def scenario():
        await engine.sample(BASE_KEY, lambda: None, sample_call(), always)
        return await asyncio.gather(
            *(
                engine.sample(snapshot, lambda: adapter_weights(1), sample_call(), always)
                for _ in range(3)
            )
        )

    asyncio.run(scenario())
    [name] = names_loaded(client)
    requested = [call[1] for call in client.calls if call[0] == "complete"]
    assert requested == [None, name, name, name]  # the base model's sampler names no adapter
    assert engine.book.find(snapshot).running == 0
    assert (tmp_path / name / "adapter_model.safetensors").is_file()


def test_an_inflight_sampler_moves_to_each_new_version_and_the_old_one_is_unloaded(tmp_path):
    client = StubVLLMClient(max_cpu_loras=8)
    engine = VLLMAdapters(client, tmp_path)
    latest = {"version": 0}

    def in_use(key) -> bool:
        return key[0] != "model" or key[2] == latest["version"]

    async def scenario():
        for version in (0, 1, 2):
            latest["version"] = version
            key = ("model", "s:train:0", version)
            await engine.sample(key, lambda v=version: adapter_weights(v), sample_call(), in_use)

    asyncio.run(scenario())
    first, second, third = names_loaded(client)
    assert ("unload", first) in client.calls and ("unload", second) in client.calls
    assert list(client.held) == [third]
    assert sorted(p.name for p in tmp_path.iterdir()) == [third]  # the old files are gone


def test_adapters_beyond_the_servers_lora_cache_are_unloaded_least_recently_used_first(tmp_path):
    client = StubVLLMClient(max_cpu_loras=2)
    engine = VLLMAdapters(client, tmp_path)
    keys = [("sampler", f"s:weights:{i}") for i in range(3)]

    async def draw(i: int) -> None:
        await engine.sample(keys[i], lambda: adapter_weights(i), sample_call(), always)

    async def scenario():
        for i in (0, 1, 0, 2, 1):  # 1 is the least recently used when 2 comes
            await draw(i)

    asyncio.run(scenario())
    a, b, c, b_again = names_loaded(client)
    unloaded = [call[1] for call in client.calls if call[0] == "unload"]
    assert unloaded == [b, a] and len(client.held) == 2
    assert b_again not in (a, b, c)  # loaded again under a fresh name


def test_a_seed_is_refused_on_a_cpu_server_and_passed_on_to_an_accelerator(tmp_path):
    cpu = StubVLLMClient(send_seed=False)
    with pytest.raises(TinkerUserError, match="sampling_params.seed"):
        asyncio.run(
            VLLMAdapters(cpu, tmp_path).sample(BASE_KEY, lambda: None, sample_call(7), always)
        )
    assert cpu.calls == []
    gpu = StubVLLMClient(send_seed=True)
    asyncio.run(VLLMAdapters(gpu, tmp_path).sample(BASE_KEY, lambda: None, sample_call(7), always))
    assert gpu.calls == [("complete", None, 7)]


def test_vllms_refusal_is_the_users_error_and_a_lost_adapter_is_loaded_again(tmp_path):
    client = StubVLLMClient()
    engine = VLLMAdapters(client, tmp_path)
    key = ("sampler", "s:weights:x")
    client.refuse = EngineRefused(400, "sampling_params.n must be at most 128")
    with pytest.raises(TinkerUserError, match="vLLM refused the sample request: sampling_params.n"):
        asyncio.run(engine.sample(BASE_KEY, lambda: None, sample_call(), always))
    asyncio.run(engine.sample(key, lambda: adapter_weights(3), sample_call(), always))
    client.held.clear()  # the server restarted
    asyncio.run(engine.sample(key, lambda: adapter_weights(3), sample_call(), always))
    first, second = names_loaded(client)
    assert first != second and list(client.held) == [second]


def test_a_rank_the_server_cannot_serve_is_refused_before_any_file_is_written(tmp_path):
    client = StubVLLMClient(max_lora_rank=2)
    engine = VLLMAdapters(client, tmp_path)
    with pytest.raises(TinkerUserError, match="rank 4 exceeds the vLLM server's --max-lora-rank 2"):
        asyncio.run(
            engine.sample(("sampler", "s"), lambda: adapter_weights(0), sample_call(), always)
        )
    assert list(tmp_path.iterdir()) == [] and names_loaded(client) == []


# ---- the peft directory --------------------------------------------------------------


def test_sampler_weights_written_as_peft_load_into_the_model_the_trainer_computes(tmp_path):
    peft = pytest.importorskip("peft")
    models = LoraModels(build_tiny_llama(VOCAB, seed=0), TrainerConfig(bf16_autocast=False))
    models.create("m", rank=4, seed=1)  # attention, MLP and the (tied) head, as Tinker's default
    tokens = np.arange(5, 17)
    datum = TinkerDatum(
        tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(11, np.float32)}
    )
    for _ in range(2):
        models.forward_backward("m", [datum], "cross_entropy")
        models.optim_step("m", AdamParams(learning_rate=5e-2))
    trained = models.forward("m", [datum], "cross_entropy").logprobs[0]

    write_peft_adapter(models.sampler_weights("m"), tmp_path / "adapter", max_rank=8)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4  # the scale is in B already
    assert {"q_proj", "down_proj", "lm_head"} <= set(config["target_modules"])
    loaded = peft.PeftModel.from_pretrained(build_tiny_llama(VOCAB, seed=0), tmp_path / "adapter")
    with torch.no_grad():
        logits = loaded(torch.as_tensor(tokens[:-1])[None]).logits[0]  # (T, V)
    logprobs = logits.log_softmax(-1)[torch.arange(11), torch.as_tensor(tokens[1:])]
    base = build_tiny_llama(VOCAB, seed=0)
    with torch.no_grad():
        base_logits = base(torch.as_tensor(tokens[:-1])[None]).logits[0]
    untrained = base_logits.log_softmax(-1)[torch.arange(11), torch.as_tensor(tokens[1:])]
    assert np.abs(untrained.numpy() - trained).max() > 0.1  # the adapter matters
    np.testing.assert_allclose(logprobs.numpy(), trained, atol=1e-5)


# ---- the command line ------------------------------------------------------------------


def test_engine_vllm_launches_a_lora_server_holding_max_loras_adapters(tmp_path):
    argv = ["--engine", "vllm", "--max-loras", "6", "--max-lora-rank", "12"]
    args = serve.build_parser().parse_args([*argv, "--vllm-arg=--enforce-eager"])
    embedded = serve._sampling_config(serve.build_parser().parse_args([]), None)
    assert embedded is None  # the default: the embedded engine's own configuration
    cfg = serve._sampling_config(args, type("Embedded", (), {"model": str(tmp_path)}))
    cfg = cfg.model_copy(update={"vllm_python": sys.executable})
    command = " ".join(VLLMServer(cfg).command())
    # vLLM takes the last of a repeated flag: ours, after the launcher's default of 2
    assert command.endswith(
        "--enable-lora --max-lora-rank 16 --max-loras 2 --max-loras 6 --enforce-eager"
    )


def test_engine_vllm_without_vllm_fails_at_start_naming_the_flag(tiny_model_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_model_dir), "--state-dir", str(tmp_path), "--engine", "vllm"]
    assert serve.main([*argv, "--vllm-python", str(tmp_path / "no-python")]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the base model's progress bar
    assert error.startswith("error: --engine vllm: engine.vllm_python") and "no-python" in error
