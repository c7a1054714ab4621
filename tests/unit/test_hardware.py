"""`keep_freed_memory`: a large block freed and allocated again stops being faulted in.
`huge_pages_for_large_tensors`: a large tensor lands on huge pages where the kernel offers
them, only when nothing was allocated before, and children inherit no setting.
`cpu_bf16_matmul_pays`: bf16 training only where the flags and a timed matmul agree, and
data-parallel ranks on a CPU take rank 0's choice. `use_threads_here`: a thread keeps its own
OpenMP thread count."""

import json
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from asyncgrpo.base import hardware
from asyncgrpo.base.config import TrainerConfig
from asyncgrpo.base.ports import free_port

# a 64 MB tensor allocated, written and freed, round after round: each round's page faults
ROUNDS_OF_FAULTS = """
import json, resource, sys, torch
from asyncgrpo.base.hardware import keep_freed_memory
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


# the process's huge pages before and after a 64 MB tensor is written, in kB
HUGE_PAGES = """
import json, os, sys, torch
from asyncgrpo.base.hardware import huge_pages_for_large_tensors
if sys.argv[1] == "late":
    torch.ones(8)
applied = huge_pages_for_large_tensors()
def huge():
    rollup = open("/proc/self/smaps_rollup").read().splitlines()
    return next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages"))
before = huge()
kept = torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
print(json.dumps([applied, huge() - before, os.environ.get("THP_MEM_ALLOC_ENABLE")]))
"""
THP_OFFERED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP_OFFERED.exists() or "[never]" in THP_OFFERED.read_text(),
    reason="the kernel offers no transparent huge pages",
)
def test_large_tensors_land_on_huge_pages_when_set_first():
    def run(mode: str) -> list:
        args = [sys.executable, "-c", HUGE_PAGES, mode]
        return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)

    applied, huge_kb, env = run("first")
    assert applied and huge_kb >= 32 << 10  # most of the 64 MB on 2 MB pages
    assert env is None  # the environment restored: a child starts as it would have
    applied, huge_kb, _ = run("late")  # a tensor existed: torch had already chosen
    assert not applied and huge_kb < 4 << 10


@pytest.fixture
def timed(monkeypatch):
    """`cpu_bf16_matmul_pays` with native-bf16 flags and the given seconds per matmul."""

    def patch(flags: bool, fp32: float, bf16: float) -> bool:
        import torch

        seconds = {torch.float32: fp32, torch.bfloat16: bf16}
        monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: flags)
        monkeypatch.setattr(hardware, "_matmul_seconds", lambda dtype: seconds[dtype])
        hardware.cpu_bf16_matmul_pays.cache_clear()
        return TrainerConfig().use_bf16_autocast("cpu")

    yield patch
    hardware.cpu_bf16_matmul_pays.cache_clear()


def test_bf16_autocast_needs_the_flags_and_a_faster_timed_matmul(timed):
    assert timed(flags=True, fp32=1.0, bf16=0.2)  # AMX: bf16 5x fp32
    assert not timed(flags=True, fp32=1.0, bf16=2.0)  # AVX512-BF16 without AMX, measured
    assert not timed(flags=True, fp32=1.0, bf16=0.9)  # a near tie goes to fp32
    assert not timed(flags=False, fp32=1.0, bf16=0.1)  # no native bf16: not even timed
    assert TrainerConfig(bf16_autocast=True).use_bf16_autocast("cpu")


def test_the_timed_matmul_is_cached_for_the_process(monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(hardware, "_matmul_seconds", lambda dtype: calls.append(dtype) or 1.0)
    hardware.cpu_bf16_matmul_pays.cache_clear()
    try:
        assert hardware.cpu_bf16_matmul_pays() == hardware.cpu_bf16_matmul_pays()
    finally:
        hardware.cpu_bf16_matmul_pays.cache_clear()
    assert len(calls) == 2  # one fp32 and one bf16 measurement, once


RANKS_AGREE = """
import os, sys, torch.distributed as dist
from asyncgrpo.learning.trainer.distributed import broadcast_flag
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
print(broadcast_flag(rank == 1))  # rank 0 says False, rank 1 True
dist.destroy_process_group()
"""


def test_data_parallel_ranks_take_rank_0s_autocast_choice():
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS_AGREE, str(rank), port], stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["False", "False"]


def test_a_threads_own_count_survives_a_later_process_wide_change():
    """PyTorch copies the process-wide count into a thread at its first op: a count set
    before that must not be overwritten by a change made elsewhere in between."""
    before = torch.get_num_threads()
    set_here, changed = threading.Event(), threading.Event()
    seen = []

    def helper():
        hardware.use_threads_here(1)
        set_here.set()
        changed.wait(10)
        torch.ones(64).add_(1)  # its first op
        seen.append(torch.get_num_threads())

    @hardware.one_thread
    def one_thread_count():
        return torch.get_num_threads()

    try:
        thread = threading.Thread(target=helper)
        thread.start()
        set_here.wait(10)
        torch.set_num_threads(2)  # as the trainer's core sharing does between layers
        changed.set()
        thread.join(10)
        assert seen == [1]
        wrapped = threading.Thread(target=lambda: seen.append(one_thread_count()))
        wrapped.start()
        wrapped.join(10)
        assert seen == [1, 1]  # `one_thread` with the process-wide count at 2
    finally:
        torch.set_num_threads(before)
