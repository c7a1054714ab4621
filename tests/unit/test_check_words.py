"""`tools/check_words.py` flags words of the development work and nothing of the product.

The product says "session", "task" and "stop" all the time (Tinker sessions, asyncio and
RL tasks, stop strings), so the checker is only useful if it stays quiet on those lines
while it catches numbered pieces of work, who-ran-where phrases and outside paths.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_words.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("check_words", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_words = load_tool()


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("measured at stop 59 on the EPYC", ["stop 59"]),
        ("Issue 32's acceptance: 5x samples/s", ["Issue 32"]),
        ("after stops 56-58 the step was 45%", ["stops 56-58"]),
        ("the fix of issue #32, see PR #4", ["issue #32", "PR #4"]),
        ("their stop-52 rates", ["stop-52"]),
        ("as in session 3 and task 12.", ["session 3", "task 12"]),
        ("the sync at stop 41. JSON and plots:", ["stop 41"]),
        ("Routes and shapes: see ../shared/TINKER.md", ["../shared"]),
        ("the wire format of shared/TINKER.md", ["shared/TINKER.md"]),
        ('"vllm_python": "/work/main/.venv-vllm/bin/python"', ["/work/"]),
        ("on one H100 (the device lent to this task)", ["lent to this task"]),
        ("on the EPYC (this session's CPU machine)", ["this session's CPU machine"]),
        ("An earlier session on a CPU with AMX", ["An earlier session on a CPU"]),
        ("left for the next stop.", ["the next stop"]),
        ("measured in this stop, not before", ["this stop"]),
        ("can deadlock the ranks (REFERENCE.md, bug 11)", ["REFERENCE.md", "bug 11"]),
        ("the engine protocol of DESIGN.md", ["DESIGN.md"]),
    ],
)
def test_flags_words_of_the_development_work(line: str, words: list[str]) -> None:
    assert check_words.find_words(line, frozenset({"README.md"})) == words


@pytest.mark.parametrize(
    "line",
    [
        "stop strings are searched in the decoded text",
        'stop_reason: str | int | None = None  # stop=["\\n"]',
        "a Tinker session that misses heartbeats is closed",
        "each group is built in an asyncio task of its own",
        "see `run/session/engine_link.py`",
        "a request the server cannot decode is answered HTTP 404",
        "the session_id of create_session; max_sessions=2",
        "--tasks 16 --episodes-per-task 8",
        "Why this task (benchmarks/base_rate.py, 32 held-out prompts)",
        "out of time before this session's first step; earlier sessions included",
        "the last stop string that matched; this stop token ends it",
        "stop the engine, then step 3 of the run",
        "polls `/get_load`, which vLLM does not serve (vllm-project/router#174)",
        "https://example.com/work/shared/x.md and docs/shared/notes.md",
        "asyncgrpo.learning.tasks.arithmetic, task_id 7, stop_token_ids [2]",
        "as README.md shows; the study writes study.md",
        "inclusionAI/AReaL benchmark/verl_v0_3_0_post1_312a8cb/README.md, batch 512",
        "a documented bug in torch 2.5; the debug 3 times",
    ],
)
def test_leaves_the_product_alone(line: str) -> None:
    assert check_words.find_words(line, frozenset({"README.md"})) == []


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A git repository with one clean tracked file and a .gitignore."""
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "clean.py").write_text('"""Stop strings end a sample."""\n')
    git(tmp_path, "add", ".gitignore", "clean.py")
    return tmp_path


def test_a_clean_repository_passes(repository: Path, capsys) -> None:
    assert check_words.main(repository) == 0
    assert capsys.readouterr().out.startswith("check_words: 2 files, none speaks")


def test_tracked_and_untracked_text_files_are_read(repository: Path, capsys) -> None:
    (repository / "tracked.md").write_text("intro\nmeasured at stop 59\n")
    git(repository, "add", "tracked.md")
    (repository / "new.py").write_text("# see ../shared/TINKER.md\n")  # untracked
    (repository / "ignored").mkdir()
    (repository / "ignored" / "log.txt").write_text("issue 32\n")
    (repository / "blob.bin").write_bytes(b"\0issue 32\n")  # binary: skipped
    (repository / "docs").mkdir()
    (repository / "docs" / "NOTES.md").write_text("the layers of DESIGN.md\n")
    (repository / "DESIGN.md").write_text("see docs/NOTES.md and NOTES.md\n")  # both inside
    (repository / "clean.py").unlink()  # tracked but removed from the work tree

    assert check_words.main(repository) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == ["new.py:1: ../shared", "tracked.md:2: stop 59"]
    assert "2 lines in 2 files" in out.err

    (repository / "DESIGN.md").unlink()  # now cited from outside the repository
    assert check_words.main(repository) == 1
    assert "docs/NOTES.md:1: DESIGN.md" in capsys.readouterr().out.splitlines()
