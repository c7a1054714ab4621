"""The decode-attention kernel in C (`kernels/decode_attention.c`): built on first use, then cached.

Why a kernel of our own? At decode, SmolLM2-135M attends 3 query heads per kv head over
~100 keys for each of 32 rows: PyTorch's CPU attention (the flash kernel, or two batched
matmuls) spends a fixed setup per (row, head) larger than that arithmetic, ~30% of a
bf16 decode step on a 2-core EPYC (docs/benchmarks/profiles.md). The kernel is one loop per
(row, kv head) over exactly the row's keys.

It is compiled with the system's C compiler for this CPU (`-march=native`) into
`cache_root()/kernels/`, keyed by the source, the compiler and the CPU's flags, and
loaded with ctypes: no build step at install, nothing compiled twice. It runs its
(row, head) loop on OpenMP threads of the libgomp PyTorch already loaded (one thread pool
a process, see hardware.use_threads_here). Where no compiler is found or the build fails,
`kernel()` is None and the engine keeps PyTorch's attention (logged once).
`ASYNCGRPO_NATIVE_ATTENTION=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
LIBS = ["-lmvec", "-lm"]  # glibc's vector expf, which the softmax loop is compiled to call
BUILD_TIMEOUT_S = 60
_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
ARGTYPES = [_PTR] * 5 + [_INT] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
DTYPES = (torch.float32, torch.bfloat16)


def decode_attention(q, k_cache, v_cache, lengths: torch.Tensor) -> torch.Tensor:
    """q (B, kv_heads, group, D) contiguous; caches (slots, kv_heads, capacity, D)
    contiguous, row b in slot b; lengths (B,) int64, the keys each row sees. Returns
    (B, kv_heads, group, D) in q's dtype. Call only when `kernel()` is not None."""
    fn = kernel()
    out = torch.empty_like(q)
    b, kv_heads, group, dim = q.shape
    failed = fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        b,
        kv_heads,
        group,
        dim,
        k_cache.stride(0),
        k_cache.stride(1),
        int(lengths.max()),
        dim**-0.5,
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("decode attention: no memory for its work buffers")
    return out


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors (and is built)."""
    return (
        q.dtype in DTYPES
        and k_cache.dtype == v_cache.dtype == q.dtype
        and q.device.type == "cpu"
        and q.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and kernel() is not None
    )


@functools.cache
def kernel():
    """The loaded C function, or None (no compiler, a failed build, or turned off)."""
    if os.environ.get("ASYNCGRPO_NATIVE_ATTENTION", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_built_library()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("decode attention stays on PyTorch's kernels: %s", exc)
        return None
    fn = library.decode_attention
    fn.restype, fn.argtypes = ctypes.c_int, ARGTYPES
    return fn


def _built_library() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = resources.files("asyncgrpo.inference.engine.kernels").joinpath(SOURCE).read_bytes()
    key = hashlib.sha256(source)
    for part in (_compiler_version(compiler), _cpu_flags(), " ".join(FLAGS + LIBS)):
        key.update(part.encode())
    from asyncgrpo.base.models import cache_root

    target = cache_root() / "kernels" / f"decode_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        src, out = Path(scratch) / SOURCE, Path(scratch) / target.name
        src.write_bytes(source)
        done = subprocess.run(
            [compiler, *FLAGS, str(src), "-o", str(out), *LIBS],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: processes building at once each install a whole file
    return target


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10)
    return done.stdout.splitlines()[0] if done.stdout else compiler


def _cpu_flags() -> str:
    """What `-march=native` compiles for: the CPU's model and flags (the machine where absent)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = ("model name", "flags", "Features", "CPU part")
    lines = {line.split(":")[0].strip(): line for line in info.splitlines() if ":" in line}
    return "\n".join(lines.get(name, "") for name in keep)
