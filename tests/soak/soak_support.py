"""What both soaks share: their length, where their summaries go, a fault schedule, memory
sampled from /proc, and the process tree.

A soak runs for `SOAK_MINUTES` (default 15; 2 is a smoke run) and ends with a summary, a
JSON file per soak in `SOAK_REPORT_DIR` (default: the test's tmp dir), printed too, so
that its figures (requests, kills, restarts, memory) can be reported.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

from child_processes import children

from asyncgrpo.testing import process_stats

MiB = 1024 * 1024


def soak_seconds() -> float:
    """The soak's length: `SOAK_MINUTES` (default 15) in seconds."""
    return float(os.environ.get("SOAK_MINUTES", "15")) * 60


def write_summary(tmp_path: Path, name: str, summary: dict) -> Path:
    """`summary` as `<SOAK_REPORT_DIR or tmp_path>/<name>.json`, and printed."""
    directory = Path(os.environ.get("SOAK_REPORT_DIR") or tmp_path)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"\n{name} summary ({path}):\n{json.dumps(summary, indent=2, sort_keys=True)}")
    return path


def fault_times(rng: random.Random, count: int, start: float, end: float) -> list[float]:
    """`count` times spread over [start, end): one uniformly in each of `count` equal
    slices, so faults are random but never all bunched together."""
    width = (end - start) / count
    return [start + width * (i + rng.random()) for i in range(count)]


def read_jsonl(path: Path) -> list[dict]:
    """The file's JSON lines; a torn last line (its writer was killed) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def rss_bytes(pid: int) -> int | None:
    """VmRSS of /proc/PID/status, or None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class RssSampler:
    """A thread that records, every `period_s`, (`time.time()`, label, pid, RSS bytes) of
    each process that `processes()` names as (label, pid) pairs."""

    def __init__(self, processes, period_s: float = 2.0):
        self.processes, self.period_s = processes, period_s
        self.samples: list[tuple[float, str, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                processes = list(self.processes())
            except Exception:  # noqa: BLE001 - a process between lives: sampled next time
                continue
            for label, pid in processes:
                rss = rss_bytes(pid)
                if rss is not None:
                    self.samples.append((time.time(), label, pid, rss))

    def stop(self) -> list[tuple[float, str, int, int]]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of y over x (0 for fewer than two distinct x)."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def process_tree(pid: int) -> list[int]:
    """Every descendant of `pid` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def in_process_group(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a killed leader's children keep it)."""
    return [pid for pid, fields in process_stats() if int(fields[2]) == pgid and fields[0] != "Z"]
