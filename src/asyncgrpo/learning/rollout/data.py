"""Prompt rows from a dataset spec, and prompts rendered to token ids.

`load_prompts(spec, seed)` reads the recipe's `dataset:` mapping. Exactly one
source key says where rows come from:

- `builtin: NAME` — a generated task from `asyncgrpo.learning.tasks` (`size`, `eval_size`
  and any other keys, which go to the task's generator);
- `path: FILE` — a local `.jsonl`, `.json` (a list of objects), `.csv` or
  `.parquet` file, or a directory written by `datasets.save_to_disk`;
- `hf: NAME` — a `datasets` dataset (`split`, optional `config`), read from the
  local cache or a local directory only: loading runs with the hub switched
  off, so a dataset that is not on disk is a clear error, never a download.

A held-out set comes from `eval_path` / `eval_split`, or from `eval_size` rows
taken out of the training rows in a seeded order (the same rows for the same
seed). `size` caps the training rows (a builtin task generates `size` +
`eval_size` distinct prompts, `size` defaulting to 1000, or all it has when its
space is smaller). `prompt_column` names the column that holds the prompt when
it is not `prompt`.

Rows follow TRL's dataset formats: `prompt` is a plain string (used as is) or a
conversation (a list of `{"role", "content"}` messages, rendered with the chat
template and the generation prompt). Other columns travel with the row to the
reward functions. Every row is checked at load; a bad one is reported by its
index and field, not at the first rollout that happens to draw it.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import random
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCE_KEYS = ("builtin", "path", "hf")
COMMON_KEYS = {"size", "eval_size", "eval_path", "eval_split", "prompt_column"}
HF_KEYS = {"split", "config"}


class DatasetError(ValueError):
    """A dataset spec or row that cannot be used, phrased for the recipe's author."""


# ---- loading -------------------------------------------------------------------------


def load_prompts(spec: Mapping[str, Any], seed: int) -> tuple[list[dict], list[dict] | None]:
    """(train_rows, eval_rows) for a `dataset:` spec; eval_rows is None without a held-out set."""
    spec = dict(spec or {})
    sources = [k for k in SOURCE_KEYS if k in spec]
    if len(sources) != 1:
        raise DatasetError(
            "dataset: give exactly one of 'builtin', 'path' or 'hf' "
            f"(got {sources or 'none'}; keys: {sorted(spec)})"
        )
    source = sources[0]
    size, eval_size = _count(spec, "size"), _count(spec, "eval_size") or 0
    column = spec.get("prompt_column", "prompt")
    if source == "builtin":
        rows, label = _builtin_rows(spec, seed, size, eval_size), f"builtin:{spec['builtin']}"
    else:
        _check_keys(spec, COMMON_KEYS | HF_KEYS | {source})
        rows, label = _source_rows(spec, source, spec.get("split", "train")), str(spec[source])
    rows = validate_rows(rows, label, column)

    eval_rows = None
    if "eval_path" in spec or "eval_split" in spec:
        if "eval_path" in spec:
            eval_label = str(spec["eval_path"])
            raw = _source_rows({"path": spec["eval_path"]}, "path", spec.get("split", "train"))
        else:
            eval_label = f"{spec.get(source)}[{spec['eval_split']}]"
            raw = _source_rows(spec, source, spec["eval_split"])
        eval_rows = validate_rows(raw, eval_label, column)
        if eval_size:
            eval_rows = [eval_rows[i] for i in sorted(_order(len(eval_rows), seed)[:eval_size])]
    elif eval_size:
        rows, eval_rows = split_rows(rows, eval_size, seed, label)
    if size is not None:
        rows = rows[:size]
    if not rows:
        raise DatasetError(f"dataset {label}: no training rows left")
    return rows, eval_rows or None


def split_rows(rows: list[dict], eval_size: int, seed: int, label: str = "dataset"):
    """Hold out `eval_size` rows chosen by a seeded shuffle; both parts keep file order."""
    if eval_size >= len(rows):
        raise DatasetError(
            f"{label}: eval_size={eval_size} leaves no training rows (it has {len(rows)})"
        )
    held = set(_order(len(rows), seed)[:eval_size])
    train = [r for i, r in enumerate(rows) if i not in held]
    return train, [rows[i] for i in sorted(held)]


def _order(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(f"asyncgrpo-eval-{seed}").shuffle(order)
    return order


def _count(spec: Mapping, key: str) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DatasetError(f"dataset.{key} must be a non-negative integer (got {value!r})")
    return value


def _check_keys(spec: Mapping, allowed: set[str]) -> None:
    import difflib

    for key in spec:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = (
                f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(sorted(allowed))}"
            )
            raise DatasetError(f"unknown key 'dataset.{key}'; {hint}")


def _builtin_rows(spec: dict, seed: int, size: int | None, eval_size: int) -> list[dict]:
    """size + eval_size distinct generated rows (the held-out ones are split off later)."""
    from asyncgrpo.learning.tasks import make_rows

    kwargs = {k: v for k, v in spec.items() if k not in COMMON_KEYS | {"builtin"}}
    for key in ("eval_path", "eval_split"):
        if key in spec:
            raise DatasetError(f"dataset.{key} is not used with a builtin task (use eval_size)")
    wanted = (1000 if size is None else size) + eval_size
    rows = make_rows(str(spec["builtin"]), wanted, seed, **kwargs)
    if len(rows) < wanted:
        logger.info(
            "builtin task %s has %d distinct prompts (asked for %d); training rows repeat "
            "across epochs",
            spec["builtin"],
            len(rows),
            wanted,
        )
    return rows


def _source_rows(spec: Mapping, source: str, split: str) -> list[dict]:
    if source == "path":
        return read_file_rows(Path(str(spec["path"])), split)
    return _hf_rows(str(spec["hf"]), spec.get("config"), split)


def read_file_rows(path: Path, split: str = "train") -> list[dict]:
    """Rows of a local data file or `save_to_disk` directory (no `datasets` cache written)."""
    if path.is_dir():
        return _from_disk(path, split)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return list(_jsonl(path))
    if suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset must be a list of objects")
        return data
    if suffix == ".csv":
        with path.open(newline="") as f:
            return [dict(r) for r in csv.DictReader(f)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DatasetError(f"{path}: unsupported file type '{suffix}' (jsonl, json, csv, parquet)")


def _jsonl(path: Path) -> Iterator[dict]:
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None


def _from_disk(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DatasetError(f"{path} is not a directory written by save_to_disk: {exc}") from None
    return _pick_split(loaded, split, str(path)).to_list()


def _pick_split(loaded: Any, split: str, label: str):
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{label} has no split '{split}' (splits: {', '.join(loaded)})")
        return loaded[split]
    return loaded


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Switch the hub off for `datasets` and `huggingface_hub` while loading: cache only."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _hf_rows(name: str, config: str | None, split: str) -> list[dict]:
    import datasets

    path = Path(name)
    if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "state.json")):
        return _from_disk(path, split)
    try:
        with _hub_offline():
            loaded = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # datasets raises many types; the message is what matters
        raise DatasetError(
            f"cannot load dataset '{name}' (split '{split}') from local files or the cache "
            f"(downloads are disabled): {type(exc).__name__}: {exc}"
        ) from exc
    return _pick_split(loaded, split, name).to_list()


def dataset_rows(
    data: Any,
    label: str,
    splits: tuple[str, ...] = ("train",),
    prompt_column: str | None = "prompt",
) -> list[dict]:
    """Checked rows of a dataset passed as an object (`AsyncGRPOTrainer(train_dataset=...)`):
    a `datasets.Dataset`, a `DatasetDict` (the first of `splits` it has), a list of dicts,
    or the path of a data file or `save_to_disk` directory (read like `dataset.path`).
    `prompt_column` None: rows need not hold a prompt (agent tasks)."""
    if isinstance(data, str | Path):
        label, data = str(data), read_file_rows(Path(data), splits[0])
    datasets = sys.modules.get("datasets")  # a datasets object means it is imported
    if datasets is not None and isinstance(data, datasets.DatasetDict):
        found = [s for s in splits if s in data]
        if not found:
            raise DatasetError(
                f"{label}: the DatasetDict has no {' or '.join(map(repr, splits))} split "
                f"(splits: {', '.join(data)}); pass one split, e.g. ds['{next(iter(data))}']"
            )
        data = data[found[0]]
    if datasets is not None and isinstance(data, datasets.Dataset):
        data = data.to_list()
    if not isinstance(data, list | tuple):
        raise DatasetError(
            f"{label}: expected a datasets.Dataset, a DatasetDict, a list of dicts or the path "
            f"of a data file, got {type(data).__name__}"
        )
    if not data:
        raise DatasetError(f"{label} is empty")
    if prompt_column is None:
        return [_mapping(row, i, label) for i, row in enumerate(data)]
    return validate_rows(data, label, prompt_column)


def _mapping(row: Any, index: int, label: str) -> dict:
    if not isinstance(row, Mapping):
        raise DatasetError(f"{label}: row {index} is a {type(row).__name__}, not a mapping")
    return dict(row)


# ---- validation ------------------------------------------------------------------------


def validate_rows(rows: Any, label: str, prompt_column: str = "prompt") -> list[dict]:
    """Rows as dicts with a valid `prompt` (copied from `prompt_column` if given)."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DatasetError(f"{label}: row {i} is a {type(row).__name__}, not a mapping")
        row = dict(row)
        if prompt_column not in row:
            raise DatasetError(
                f"{label}: row {i} has no '{prompt_column}' column (columns: {sorted(row)}); "
                "rename the prompt column to 'prompt' or set dataset.prompt_column"
            )
        if prompt_column != "prompt":
            row["prompt"] = row.pop(prompt_column)
        problem = prompt_problem(row["prompt"])
        if problem:
            raise DatasetError(f"{label}: row {i}, field '{prompt_column}': {problem}")
        out.append(row)
    return out


def prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` is not a usable TRL prompt, or None when it is."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty"
    if not isinstance(prompt, list):
        return f"expected a string or a list of chat messages, got {type(prompt).__name__}"
    if not prompt:
        return "the conversation is empty"
    for j, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"message {j} is a {type(message).__name__}, not a mapping"
        if not isinstance(message.get("role"), str):
            return f"message {j} has no string 'role'"
        content = message.get("content")
        if not isinstance(content, str | list) and not message.get("tool_calls"):
            return f"message {j} has no 'content' (string or list of parts)"
    return None


# ---- rendering -----------------------------------------------------------------------


def render_prompt(tokenizer: Any, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt, ready for the engine.

    Conversational prompts go through the chat template with the generation prompt
    (`<|im_start|>assistant\\n` for ChatML). Plain strings are used as is, without
    special tokens, as TRL does: whatever the string says is exactly the prompt.
    """
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    return _as_id_list(ids)


def _as_id_list(ids: Any) -> list[int]:
    """transformers returns a list, a BatchEncoding/dict or a tensor depending on version."""
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        if len(ids) != 1:
            raise ValueError(f"expected one prompt's ids, got a batch of {len(ids)}")
        ids = ids[0]
    return [int(t) for t in ids]
