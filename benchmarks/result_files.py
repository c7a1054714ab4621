"""Where a benchmark's figures go: one JSON file per run, named by date and machine kind.

A number is only worth keeping with what produced it: the code (commit, and whether the
working tree differed from it), the machine (CPU model, family and model, core count,
memory, the flags that decide the fast paths: AVX2, AVX512F, AVX512-BF16, AMX; the torch
version and the GPU), and the exact command. `write_result` stores all of them beside the
figures in `benchmarks/results/<benchmark>/<date>-<machine>.json`, where `<machine>` is
`machine_slug()`: a short name of the machine kind (`epyc-f25m17-bf16-2c`,
`xeon-f6m143-amx-2c`, `h100`). A second run on the same day and kind gets `-2`, `-3`, ...:
nothing is overwritten. Paths inside the checkout are written relative to it and the home
folder as `~`, since the files are committed. `benchmarks/table.py` renders the latest file
per benchmark and kind.

The folder is `benchmarks/results/` unless `out_root` or the environment variable
`ASYNCGRPO_RESULTS_DIR` names another. A benchmark run under pytest (which sets
`PYTEST_CURRENT_TEST`) without either writes under the system's temporary folder, so that
smoke runs on tiny models never land among the recorded results.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from headlines import headline

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the scripts' own outputs beside the result file (server logs, plots, run folders): ignored
SCRATCH = ROOT / "runs" / "benchmarks"
ENV_VAR = "ASYNCGRPO_RESULTS_DIR"
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
BRANDS = ("epyc", "xeon", "ryzen", "core")
VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}
ISA_WORDS = {
    "amx": "AMX",
    "bf16": "AVX512-BF16, no AMX",
    "avx512": "AVX512F, no AVX512-BF16",
    "avx2": "AVX2, no AVX512",
}
GPU_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "amd", "radeon", "instinct"}


def cpuinfo(text: str | None = None) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def torch_and_gpu() -> tuple[str | None, dict | None]:
    """torch's version and the GPUs it sees (name and count), if torch is installed."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return torch.__version__, None
    return torch.__version__, {
        "name": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
    }


def isa_tag(flags: dict[str, bool | None]) -> str | None:
    """The widest matrix path the flags promise: amx, bf16 (AVX512-BF16), avx512, avx2."""
    if flags.get("amx_bf16") or flags.get("amx_tile"):
        return "amx"
    for flag, tag in (("avx512_bf16", "bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flags.get(flag):
            return tag
    return None


def machine_description(info: dict[str, str] | None = None) -> dict:
    """What the benchmark ran on: CPU, memory, the flags that matter, torch and the GPU."""
    info = cpuinfo() if info is None else info
    present = set(info.get("flags", "").split())
    flags = {flag: flag in present for flag in FLAGS} if present else dict.fromkeys(FLAGS)
    torch_version, gpu = torch_and_gpu()
    cpu_model = info.get("model name") or platform.processor() or platform.machine()
    description = {
        "cpu_model": cpu_model,
        "vendor": info.get("vendor_id"),
        "family": int(info["cpu family"]) if info.get("cpu family", "").isdigit() else None,
        "model": int(info["model"]) if info.get("model", "").isdigit() else None,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(),
        "flags": flags,
        "torch": torch_version,
        "gpu": gpu,
        "platform": platform.platform(),
    }
    description["description"] = describe(description)
    description["slug"] = machine_slug(description)
    return description


def describe(description: dict) -> str:
    """'2-core AMD EPYC, family 25 model 17, AVX512-BF16, no AMX' (and the GPU, if any)."""
    words = [f"{description['cores']}-core {description['cpu_model']}"]
    if description.get("family") is not None:
        words.append(f"family {description['family']} model {description['model']}")
    words.append(ISA_WORDS.get(isa_tag(description.get("flags") or {}), "flags unknown"))
    gpu = description.get("gpu")
    if gpu:
        words.append(f"{gpu['count']} x {gpu['name']}")
    return ", ".join(words)


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the words up to the first with a digit in it."""
    words = [w for w in name.replace("-", " ").split() if w.lower() not in GPU_VENDOR_WORDS]
    kept = []
    for word in words:
        kept.append(word.lower())
        if any(c.isdigit() for c in word):
            break
    return "".join(kept) or "gpu"


def cpu_brand(description: dict) -> str:
    name = (description.get("cpu_model") or "").lower().replace("(r)", "").replace("(tm)", "")
    for brand in BRANDS:
        if brand in name.split():
            return brand
    return VENDORS.get(description.get("vendor") or "", platform.machine().lower() or "cpu")


def machine_slug(description: dict | None = None) -> str:
    """A short name of the machine kind: the GPU where torch sees one (`h100`, `h100x8`),
    else the CPU's brand, family and model, widest matrix path and core count
    (`epyc-f25m17-bf16-2c`)."""
    description = machine_description() if description is None else description
    gpu = description.get("gpu")
    if gpu:
        count = gpu.get("count") or 1
        return gpu_slug(gpu["name"]) + (f"x{count}" if count > 1 else "")
    parts = [cpu_brand(description)]
    if description.get("family") is not None and description.get("model") is not None:
        parts.append(f"f{description['family']}m{description['model']}")
    tag = isa_tag(description.get("flags") or {})
    if tag:
        parts.append(tag)
    if description.get("cores"):
        parts.append(f"{description['cores']}c")
    return "-".join(parts)


def git_commit() -> dict:
    """HEAD of the checkout the benchmark ran from, and whether its tracked files differ
    from it (new untracked files, such as result files, do not count)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", str(ROOT), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def command_line(benchmark: str, argv: list[str] | None) -> str:
    """The command that reruns it, shell-quoted, paths relative to the repository root."""
    args = sys.argv[1:] if argv is None else list(argv)
    python = Path(os.path.normpath(os.path.abspath(sys.executable)))
    if python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    return shlex.join([str(python), f"benchmarks/{benchmark}.py", *map(str, args)])


def portable(value):
    """`value` with paths inside the checkout made relative to it and the home folder
    written `~`: a committed result should not name the disk it was measured on."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        value = value.replace(str(ROOT) + os.sep, "")
        home = str(Path.home())
        return value.replace(home + os.sep, "~" + os.sep) if home != os.sep else value
    if isinstance(value, dict):
        return {key: portable(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    return value


def results_root(out_root: Path | str | None = None) -> Path:
    if out_root is not None:
        return Path(out_root)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    if os.environ.get("PYTEST_CURRENT_TEST"):
        return Path(tempfile.gettempdir()) / "asyncgrpo-benchmark-results"
    return RESULTS


def write_result(
    benchmark: str,
    figures,
    argv: list[str] | None = None,
    out_root: Path | str | None = None,
) -> Path:
    """Write `figures` (the script's results, any JSON value) with the date, commit, machine
    and command to `<root>/<benchmark>/<date>-<machine>.json`, never over an existing
    file; its path. `argv`: the script's arguments (default: `sys.argv[1:]`)."""
    machine, figures = machine_description(), portable(figures)
    now = time.gmtime()
    record = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
        "commit": git_commit(),
        "machine": machine,
        "command": command_line(benchmark, argv),
        "headline": headline(benchmark, figures),
        "figures": figures,
    }
    text = json.dumps(record, indent=1, default=str) + "\n"
    folder = results_root(out_root) / benchmark
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d', now)}-{machine['slug']}"
    for n in range(1, 10_000):
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with path.open("x") as f:  # exclusive: a file written meanwhile is kept too
                f.write(text)
        except FileExistsError:
            continue
        print(f"result: {path}")
        return path
    raise RuntimeError(f"no free result file name for {stem} in {folder}")
