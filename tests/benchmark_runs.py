"""Running a script of `benchmarks/` as its users do, on a recipe for the tiny model.

The smoke tests (`tests/integration/test_benchmarks_smoke.py`, and the vLLM systems in
`tests/vllm/test_benchmarks_vllm.py`) run each script from the repository root, so they
catch what rots in a script: an import that moved, a flag or a function that changed,
a result file that lost a key. `run_benchmark` starts it as a child process;
`run_benchmark_here` runs its `__main__` in the test process instead, for the scripts that
would otherwise spend most of their few seconds importing torch and transformers again
(the processes a script starts itself are still started).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import yaml

from asyncgrpo.testing import tiny_prompt_rows

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float = 300) -> str:
    """`python benchmarks/<script> ARGS` from the repository root; its output. A script
    that fails (or hangs) fails the test with the end of that output."""
    cmd = [sys.executable, str(BENCHMARKS / script), *args]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as err:
        output = err.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        raise AssertionError(f"{script} ran past {timeout:g} s:\n{output[-4000:]}") from None
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def run_benchmark_here(
    script: str, *args: str, timeout: float = 300, inline_children: bool = False
) -> None:
    """`python benchmarks/<script> ARGS` from the repository root, run in this process: its
    `__main__` with that `sys.argv`, `benchmarks/` first on `sys.path`, the repository root
    as working directory. A script that exits non-zero fails the test, one that runs past
    `timeout` seconds is interrupted; torch's thread count and random state come back as
    they were. With `inline_children`, the script's own `subprocess.run` of another script
    of `benchmarks/` (a worker per variant, the TRL baseline) runs here the same way, its
    output captured or written where the script asked; any other command still starts."""

    def ran_too_long(signum, frame):
        raise AssertionError(f"{script} ran past {timeout:g} s")

    previous = signal.signal(signal.SIGALRM, ran_too_long)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    real_run = subprocess.run
    if inline_children:
        subprocess.run = functools.partial(run_inline, real_run)
    try:
        code = run_main(BENCHMARKS / script, list(args))
        assert code == 0, f"{script} exited {code}"
    finally:
        subprocess.run = real_run
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_main(path: Path, args: list[str]) -> int:
    """The script's `__main__` as `python <path> ARGS` from the repository root would run it;
    its exit status. Exceptions other than `SystemExit` propagate."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    try:
        sys.argv = [str(path), *args]
        sys.path.insert(0, str(path.parent))
        os.chdir(ROOT)
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exited:  # `raise SystemExit(main())`, or argparse refusing
        return 0 if exited.code is None else exited.code if isinstance(exited.code, int) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    return 0


def run_inline(real_run, cmd, *args, **kwargs):
    """`subprocess.run` for a benchmark script under `run_benchmark_here(inline_children=
    True)`: `[python, benchmarks/<x>.py, ...]` runs in this process, as a child would
    (a traceback goes to its stderr and exits 1); anything else goes to the real one."""
    is_script = (
        isinstance(cmd, list)
        and len(cmd) >= 2
        and cmd[0] == sys.executable
        and Path(cmd[1]).resolve().parent == BENCHMARKS
    )
    if not is_script:
        return real_run(cmd, *args, **kwargs)
    capture = kwargs.get("capture_output", False)
    out = io.StringIO() if capture else kwargs.get("stdout") or sys.stdout
    err = io.StringIO() if capture else out if kwargs.get("stderr") == subprocess.STDOUT else None
    err = err or kwargs.get("stderr") or sys.stderr
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_main(Path(cmd[1]), list(cmd[2:]))
        except Exception:
            traceback.print_exc()
            code = 1
    done = subprocess.CompletedProcess(
        cmd, code, out.getvalue() if capture else None, err.getvalue() if capture else None
    )
    if kwargs.get("check"):
        done.check_returncode()
    return done


def write_tiny_recipe(directory: Path, model_dir: Path, **top_level) -> Path:
    """A recipe on the tiny model: 40 chat prompts (4 held out), groups of 2 completions of
    at most 6 tokens, 2 groups per step, one thread per process."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in tiny_prompt_rows(40)))
    recipe = {
        "name": "tiny",
        "output_dir": str(directory / "runs"),
        "seed": 0,
        "max_steps": 2,
        "eval_steps": 1,
        "checkpoint_steps": 100,
        "model": {"name_or_path": str(model_dir)},
        "engine": {"dtype": "float32", "num_threads": 1, "max_num_seqs": 16, "max_model_len": 128},
        "dataset": {"path": str(data), "eval_size": 4},
        "rewards": ["asyncgrpo.testing:even_token_reward"],
        "rollout": {"num_generations": 2, "max_tokens": 6},
        "coordinator": {"batch_groups": 2, "max_staleness": 1},
        "trainer": {
            "learning_rate": 1e-3,
            "micro_batch_tokens": 256,
            "bf16_autocast": False,
            "num_threads": 1,
        },
        **top_level,
    }
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path
