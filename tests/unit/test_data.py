"""Dataset loading for every source kind, held-out splits, row checks, prompt rendering."""

import csv
import json

import pytest

from asyncgrpo.learning.rollout.data import DatasetError, load_prompts, render_prompt
from asyncgrpo.testing import build_tiny_tokenizer


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ROWS = [{"prompt": chat(f"question {i}"), "answer": str(i)} for i in range(20)]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_builtin_task_sizes_and_held_out_rows():
    spec = {"builtin": "arithmetic", "size": 30, "eval_size": 8, "max_operand": 9}
    train, held = load_prompts(spec, seed=5)
    assert len(train) == 30 and len(held) == 8
    assert load_prompts(spec, seed=5) == (train, held), "same seed, same rows"
    assert load_prompts(spec, seed=6)[1] != held
    train_prompts = {r["prompt"][0]["content"] for r in train}
    assert not train_prompts & {r["prompt"][0]["content"] for r in held}
    small, _ = load_prompts({"builtin": "arithmetic", "size": 1000, "max_operand": 2}, 0)
    assert len(small) == 9, "a small task gives its distinct prompts, not repeats"
    with pytest.raises(ValueError, match="did you mean 'word_count'"):
        load_prompts({"builtin": "word_cnt"}, 0)


def test_jsonl_with_eval_size_is_deterministic_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    train, held = load_prompts({"path": str(path), "eval_size": 4}, seed=1)
    assert len(train) == 16 and len(held) == 4
    assert load_prompts({"path": str(path), "eval_size": 4}, seed=1) == (train, held)
    assert {r["answer"] for r in train} | {r["answer"] for r in held} == {str(i) for i in range(20)}
    assert [int(r["answer"]) for r in train] == sorted(int(r["answer"]) for r in train)
    again, none = load_prompts({"path": str(path), "size": 5}, seed=1)
    assert again == ROWS[:5] and none is None


def test_eval_path_json_and_plain_text_prompts(tmp_path):
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    eval_path = tmp_path / "eval.json"
    eval_path.write_text(json.dumps([{"prompt": "2 + 2 =", "answer": "4"}] * 3))
    train, held = load_prompts({"path": str(train_path), "eval_path": str(eval_path)}, 0)
    assert len(train) == 20 and held == [{"prompt": "2 + 2 =", "answer": "4"}] * 3


def test_csv_with_prompt_column(tmp_path):
    path = tmp_path / "d.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows({"question": f"What is {i} + 1?", "answer": i + 1} for i in range(6))
    train, held = load_prompts({"path": str(path), "prompt_column": "question"}, 0)
    assert train[0] == {"prompt": "What is 0 + 1?", "answer": "1"} and held is None


def test_parquet_and_save_to_disk_and_hf_directory(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert load_prompts({"path": str(tmp_path / "d.parquet")}, 0)[0] == ROWS
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(
        str(tmp_path / "saved")
    )
    spec = {"hf": str(tmp_path / "saved"), "split": "train", "eval_split": "test"}
    train, held = load_prompts(spec, 0)
    assert train == ROWS and held == ROWS[:3]
    assert load_prompts({"path": str(tmp_path / "saved")}, 0)[0] == ROWS
    with pytest.raises(DatasetError, match="no split 'validation'"):
        load_prompts({"hf": str(tmp_path / "saved"), "split": "validation"}, 0)


def test_hf_name_not_on_disk_is_a_clear_error_without_download():
    with pytest.raises(DatasetError, match="downloads are disabled"):
        load_prompts({"hf": "nobody-here/no-such-dataset-xyz"}, 0)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": chat("ok")}, {"question": "x"}], r"row 1 has no 'prompt' column"),
        ([{"prompt": chat("ok")}, {"prompt": 3}], r"row 1, field 'prompt': expected a string"),
        ([{"prompt": ""}], r"row 0, field 'prompt': the prompt is empty"),
        ([{"prompt": []}], r"row 0, field 'prompt': the conversation is empty"),
        ([{"prompt": [{"content": "hi"}]}], r"row 0.*message 0 has no string 'role'"),
        ([{"prompt": [{"role": "user"}]}], r"row 0.*message 0 has no 'content'"),
        ([["not", "a", "dict"]], r"row 0 is a list"),
    ],
)
def test_bad_rows_name_the_row_and_field(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=message):
        load_prompts({"path": str(path)}, 0)


def test_bad_specs_are_clear(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DatasetError, match="exactly one of"):
        load_prompts({}, 0)
    with pytest.raises(DatasetError, match="exactly one of"):
        load_prompts({"path": str(path), "builtin": "arithmetic"}, 0)
    with pytest.raises(DatasetError, match="did you mean 'eval_size'"):
        load_prompts({"path": str(path), "eval_sise": 3}, 0)
    with pytest.raises(DatasetError, match="leaves no training rows"):
        load_prompts({"path": str(path), "eval_size": 20}, 0)
    with pytest.raises(DatasetError, match="non-negative integer"):
        load_prompts({"path": str(path), "size": "ten"}, 0)
    with pytest.raises(DatasetError, match="not found"):
        load_prompts({"path": str(tmp_path / "missing.jsonl")}, 0)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DatasetError, match=r"broken.jsonl:2: not valid JSON"):
        load_prompts({"path": str(tmp_path / "broken.jsonl")}, 0)
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DatasetError, match="unsupported file type"):
        load_prompts({"path": str(tmp_path / "d.txt")}, 0)


def test_render_conversational_prompt_uses_the_template(tokenizer):
    ids = render_prompt(tokenizer, chat("Hello"))
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert tokenizer.decode(ids) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_render_plain_prompt_is_used_as_is(tokenizer):
    ids = render_prompt(tokenizer, "What is 2 + 2?")
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert tokenizer.decode(ids) == "What is 2 + 2?"
    assert tokenizer.bos_token_id not in ids, "no special tokens are added to plain prompts"
