"""What the CPU can do, for defaults that the engine and the trainer both choose by it."""

from __future__ import annotations


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); otherwise fp32 is faster."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
