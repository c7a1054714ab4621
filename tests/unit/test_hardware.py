"""`keep_freed_memory`: a large block freed and allocated again stops being faulted in."""

import json
import platform
import subprocess
import sys

import pytest

# a 64 MB tensor allocated, written and freed, round after round: each round's page faults
ROUNDS_OF_FAULTS = """
import json, resource, sys, torch
from asyncgrpo.hardware import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(40):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
PAGES = (64 << 20) // 4096


def faults_per_round(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS_OF_FAULTS, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_block_is_reused_without_page_faults():
    # glibc's default: a block this large is a fresh mmap each round, every page faulted
    assert min(faults_per_round("default")[-10:]) > PAGES // 2
    # kept: after a few rounds (freed blocks coalesce into one that fits) none are faulted
    assert sum(faults_per_round("keep")[-10:]) < PAGES // 10
