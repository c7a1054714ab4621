"""What the CPU can do, for defaults that the engine and the trainer both choose by it."""

from __future__ import annotations

import functools
import time


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); otherwise fp32 is faster."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


BF16_MARGIN = 1.2
"""bf16 must multiply at least this much faster than fp32 to be chosen for training: fp32 is
the more exact of the two, so a near tie goes to it. Only a CPU whose ratio sits near this
margin could choose differently from run to run; the kinds measured sit far from it (bf16 at
0.5x, 2-3x and ~5x fp32)."""


@functools.cache
def cpu_bf16_matmul_pays() -> bool:
    """True when this CPU's bf16 matmuls are clearly faster than fp32 ones: the flags say
    native bf16 and a timed product agrees (~0.2 s, once per process).

    The flags alone mislead: on a 2-core Xeon VM that reports AVX512-BF16 but no AMX, oneDNN's
    bf16 kernel ran a 2048x576x1536 product at 0.08 TFLOP/s and MKL's fp32 one at 0.16, so
    bf16 autocast would halve the trainer's speed; with AMX bf16 is ~5x fp32, on an
    AVX512-BF16 EPYC 2-3x."""
    if not cpu_has_native_bf16():
        return False
    import torch

    return _matmul_seconds(torch.float32) >= BF16_MARGIN * _matmul_seconds(torch.bfloat16)


def _matmul_seconds(dtype, rows: int = 1024, inner: int = 576, out: int = 1536) -> float:
    """The fastest of 3 timed `linear`s after a warm-up, at a small model's MLP shape."""
    import torch

    x = torch.randn(rows, inner, dtype=dtype)
    w = torch.randn(out, inner, dtype=dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def use_threads_here(count: int) -> None:
    """Run the calling thread's torch ops on `count` OpenMP threads.

    PyTorch's OpenMP (libgomp) gives each thread that starts parallel work its own pool of
    workers, and once a process holds more pool threads than cores, every pool's workers
    sleep between parallel regions instead of spinning, so each small op waits for a
    wake-up: the engine's decode step at batch 32 on 2 cores took 36 ms on the one thread
    that held a pool and 65-125 ms beside a second pool. So in a process one thread
    computes on several threads (the engine's, the trainer's) and helper threads that copy
    tensors run on one (`one_thread`).

    PyTorch copies the process-wide count into a thread's own at its first parallel op,
    which would undo a setting made before it: asking for the count first takes that copy.
    """
    import torch

    torch.get_num_threads()
    torch.set_num_threads(count)


def threads_here() -> int:
    """The calling thread's torch thread count (what `use_threads_here` gave it)."""
    import torch

    return torch.get_num_threads()


def one_thread(fn):
    """`fn` for a helper thread (`asyncio.to_thread`, an executor): its torch ops run on
    one OpenMP thread and so start no second pool (`use_threads_here`)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        use_threads_here(1)
        return fn(*args, **kwargs)

    return run


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse in this process, instead of giving
    large blocks back to the kernel on every free. Returns whether it applied (glibc only).

    A CPU training step allocates and frees the same large buffers every step (logits,
    the tied embedding's gradient, bf16 copies of weights). glibc serves blocks over
    32 MB with fresh `mmap`s, so each step faulted them in again: 2.0M minor faults
    against 0.86M, and the default recipe's training step at one thread took 3.55 and 3.73 s
    against 3.02 and 3.08 s with the memory kept (`benchmarks/trainer_speed.py`, two
    interleaved pairs). The cost: the resident size never shrinks, and a freed block is
    reused only once it coalesces with a neighbour (torch asks for aligned blocks a
    little larger than the one just freed), so a few freed copies of the largest buffer
    stay resident. The embedded engine was not faster with it: only trainers call this."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # every block from the heap, and the heap's top never trimmed: freed blocks are reused
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


_THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator: huge pages for tensors >= 2 MB
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_for_large_tensors() -> bool:
    """Have torch's CPU allocator back this process's tensors of 2 MB and more with
    transparent huge pages (`THP_MEM_ALLOC_ENABLE`: page-aligned, then
    madvise(MADV_HUGEPAGE)). Returns whether it applies.

    A training step's large buffers (logits, the head's gradient, bf16 weight copies) are
    faulted in 4 KB at a time whenever the kernel has taken their pages back, which
    `keep_freed_memory` cannot prevent on a VM that reclaims idle memory (kdamond): on a
    2-core EPYC, steady steps of SmolLM2-135M faulted 24-112k pages; with huge pages
    0.1-20k, and 5 of 6 steps ran faster (median 6.27 against 6.50 s).

    torch reads the variable once, at the process's first CPU allocation, so this must
    run before any tensor exists (else it returns False). It latches the setting with its
    own first allocations and restores the environment: child processes (the engine) start as they
    would have."""
    try:
        with open(_THP_SETTING) as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    import os

    import torch

    ours = _THP_ENV not in os.environ  # a user's own setting stands, and stays
    os.environ.setdefault(_THP_ENV, "1")
    try:
        # huge-page allocations are page-aligned, others 64-byte aligned: eight in a row
        # aligned by chance is a 1 in 64^8 event
        probes = [torch.empty(4 << 20, dtype=torch.uint8) for _ in range(8)]
    finally:
        if ours:
            del os.environ[_THP_ENV]
    return all(p.data_ptr() % 4096 == 0 for p in probes)
