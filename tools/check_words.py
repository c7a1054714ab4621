"""The repository speaks of the product alone: no words of how it was developed.

Comments, docstrings and documents say what the code does and why. A reference to a
numbered piece of the development work ("issue" or "stop" with a number), to the
machine someone happened to measure on ("lent to this task"), or to a file outside
the repository means nothing to a reader of the repository, and goes stale without
anyone noticing. `make lint` runs this script over every file git tracks or would
track (untracked but not ignored), text files only, and prints `path:line: words` for
each hit; it exits 1 when there is any.

The patterns are narrow on purpose, because the product uses the same words: Tinker
sessions and `run/session/`, asyncio tasks and RL tasks (`learning/tasks/`), stop
strings and `stop_reason`, and training steps. A hit needs a number right after the
word, a phrase that only a work log would use, a path that leaves the repository, or a
document cited by a name that no file of the repository has.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# A word of the work (issue, stop, session, task, ticket, PR, bug; plural too) with a
# number right after it, a `#` or a dash allowed between, and optionally a range.
# Not after a letter, digit, `_`, `-`, `.` or `/`, so that flags and names such as
# `--tasks 16`, `--episodes-per-task 8`, `max_sessions=2` or a path do not count.
NUMBERED_WORK = re.compile(
    r"(?<![\w./-])(?:issue|stop|session|task|ticket|pr|bug)s?(?:\s|-)?#?\d+"
    r"(?:\s?[-\u2013]\s?\d+)?(?!\w|\.\d)",
    re.IGNORECASE,
)

# Who ran what, where: "the device lent to this task", "this session's CPU machine",
# "an earlier session on a CPU". A training session (`run/session/`: "this session's
# first step", "earlier sessions included") and an RL task ("why this task") stay free:
# only a machine, device or accelerator named with the phrase counts.
MACHINE_OF_THE_WORK = re.compile(
    r"\blent to (?:this|that|the|our) (?:task|session)\b"
    r"|\b(?:this|that|an earlier|the earlier|the previous|the next|a later) "
    r"(?:session|task)(?:'s)?\s+(?:(?:on|with)\s+)?(?:(?:an?|the|one|its)\s+)?"
    r"(?:[\w-]+\s+)?(?:cpu|gpu|h100|h200|device|machine|accelerator)s?\b",
    re.IGNORECASE,
)

# "stop" as a unit of work: "this stop", "the next stop". Not a stop string, stop token,
# stop reason or any other noun that "stop" qualifies in the product.
STOP_OF_THE_WORK = re.compile(
    r"\b(?:this|the next|the previous|the last|an earlier|the earlier|a later) stop\b"
    r"(?![_-])(?!'?s?\s+(?:strings?|tokens?|reasons?|sequences?|ids?|words?|conditions?"
    r"|criteria|signals?|requests?|events?|flags?|texts?|matched)\b)",
    re.IGNORECASE,
)

# Files outside the repository: "../shared/TINKER.md", "shared/NOTES.md", "/work/main/".
# A path inside the repository that has a `shared` folder (`docs/shared/x.md`) is not
# cited from outside, hence the look-behind; a URL's path has a host before it.
OUTSIDE_FILE = re.compile(
    r"\.\.[/\\]shared\b|(?<![\w./-])shared/[\w.-]+\.md\b|(?<![\w.~-])/work/",
)

PATTERNS = (NUMBERED_WORK, MACHINE_OF_THE_WORK, STOP_OF_THE_WORK, OUTSIDE_FILE)

# A document cited by its bare name, as a project's notes are ("DESIGN.md"): outside the
# repository unless one of its files has that name (`README.md` does). A name at the end
# of a path (`benchmark/verl/README.md`, another project's) is that path's, hence the
# look-behind.
DOCUMENT_NAME = re.compile(r"(?<![\w./-])[A-Z][A-Z0-9_-]*\.md\b")

# The checker and its test hold the words they look for, as patterns and as samples.
EXEMPT = frozenset({"tools/check_words.py", "tests/unit/test_check_words.py"})


def find_words(line: str, documents: frozenset[str] = frozenset()) -> list[str]:
    """The words of development work in `line`, in the order they appear; `documents`:
    the names of the repository's files, which a line may cite by name."""
    spans = [(match.start(), match.group(0)) for p in PATTERNS for match in p.finditer(line)]
    spans += [
        (match.start(), match.group(0))
        for match in DOCUMENT_NAME.finditer(line)
        if match.group(0) not in documents
    ]
    return [words for _, words in sorted(spans)]


def repository_files(root: Path) -> list[str]:
    """The files git tracks, and the untracked ones it would track (not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    return sorted({name for name in listed.decode().split("\0") if name})


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file, or one removed from the work tree."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits_in(root: Path, name: str, documents: frozenset[str]) -> list[str]:
    """`name:line: words` for each line of the file `name` that has any."""
    text = text_of(root / name)
    if text is None or name in EXEMPT:
        return []
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = find_words(line, documents)
        if words:
            found.append(f"{name}:{number}: {', '.join(words)}")
    return found


def main(root: Path) -> int:
    names = repository_files(root)
    documents = frozenset(Path(name).name for name in names)
    hits = [hit for name in names for hit in hits_in(root, name, documents)]
    for hit in hits:
        print(hit)
    if hits:
        files = len({hit.split(":", 1)[0] for hit in hits})
        print(
            f"check_words: {len(hits)} lines in {files} files speak of the development "
            "work or cite files outside the repository; say what the product does instead",
            file=sys.stderr,
        )
        return 1
    print(f"check_words: {len(names)} files, none speaks of the development work")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parents[1]))
