"""The benchmarks' result files (`benchmarks/result_files.py`) and their table
(`benchmarks/table.py`): the file's name and fields, the machine kind read from
/proc/cpuinfo, no file ever overwritten, and the page showing the newest file per kind."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ENGINE_FIGURES = {
    "results": [
        {"system": "embedded", "workload": "fixed64", "tok_s": 300.0},
        {"system": "vllm-cpu", "workload": "fixed64", "tok_s": 200.0},
    ]
}
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: GenuineIntel
"""


@pytest.fixture
def results(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other by name
    return importlib.import_module("result_files")


@pytest.fixture
def table(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("table")


def test_the_file_is_named_by_date_and_machine_and_holds_every_field(results, tmp_path):
    argv = ["--threads", "2", "a b"]
    path = results.write_result("engine_throughput", ENGINE_FIGURES, argv, out_root=tmp_path)
    record = json.loads(path.read_text())
    machine = record["machine"]
    assert path.parent == tmp_path / "engine_throughput"
    assert path.name == f"{time.strftime('%Y-%m-%d', time.gmtime())}-{machine['slug']}.json"
    assert machine["slug"] == results.machine_slug()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["date"])
    assert record["date"].startswith(path.name[:10])
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]["sha"])  # this checkout's HEAD
    assert isinstance(record["commit"]["dirty"], bool)
    assert set(machine) >= {"cpu_model", "vendor", "family", "model", "cores", "memory_gib"}
    assert set(machine) >= {"flags", "torch", "gpu", "description"}
    assert set(machine["flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert record["command"].endswith("benchmarks/engine_throughput.py --threads 2 'a b'")
    assert shlex.split(record["command"])[2:] == argv
    assert record["figures"] == ENGINE_FIGURES
    assert record["headline"] == {"embedded fixed64 tok/s": 300.0, "fixed64 vs vllm-cpu": 1.5}


def test_an_existing_file_is_never_overwritten(results, tmp_path):
    first = results.write_result("head_passes", {"n": 1}, [], out_root=tmp_path)
    second = results.write_result("head_passes", {"n": 2}, [], out_root=tmp_path)
    taken = first.with_name(first.stem + "-3.json")
    taken.write_text("someone else's")
    fourth = results.write_result("head_passes", {"n": 4}, [], out_root=tmp_path)
    assert second.name == first.stem + "-2.json"
    assert fourth.name == first.stem + "-4.json"
    assert taken.read_text() == "someone else's"
    figures = [json.loads(p.read_text())["figures"]["n"] for p in (first, second, fourth)]
    assert figures == [1, 2, 4]


def test_the_environment_names_the_folder_and_tests_stay_out_of_the_repository(
    results, tmp_path, monkeypatch
):
    monkeypatch.setenv("ASYNCGRPO_RESULTS_DIR", str(tmp_path))
    assert results.write_result("base_rate", [], []).parent == tmp_path / "base_rate"
    monkeypatch.delenv("ASYNCGRPO_RESULTS_DIR")
    assert results.results_root() != results.RESULTS  # pytest sets PYTEST_CURRENT_TEST
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert results.results_root() == BENCHMARKS / "results"


def test_the_machine_is_read_from_cpuinfo(results):
    info = results.cpuinfo(ZEN4)
    assert info["vendor_id"] == "AuthenticAMD"  # the first processor's fields only
    description = results.machine_description(info)
    assert (description["family"], description["model"]) == (25, 17)
    assert description["flags"] == {
        "avx2": True,
        "avx512f": True,
        "avx512_bf16": True,
        "amx_bf16": False,
        "amx_tile": False,
    }
    if description["gpu"] is None:
        assert description["slug"] == f"epyc-f25m17-bf16-{description['cores']}c"


def cpu(name, vendor, family, model, **flags):
    every = dict.fromkeys(("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"), False)
    return {"cpu_model": name, "vendor": vendor, "family": family, "model": model, "cores": 2}, {
        **every,
        **flags,
    }


@pytest.mark.parametrize(
    ("description", "slug"),
    [
        (
            cpu(
                "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
                "GenuineIntel",
                6,
                143,
                amx_bf16=True,
            ),
            "xeon-f6m143-amx-2c",
        ),
        (cpu("AMD EPYC 7B13", "AuthenticAMD", 25, 1, avx2=True), "epyc-f25m1-avx2-2c"),
        (
            cpu("Intel(R) Xeon(R) CPU @ 2.50GHz", "GenuineIntel", 6, 85, avx512f=True),
            "xeon-f6m85-avx512-2c",
        ),
        (cpu("Some CPU", "AuthenticAMD", None, None), "amd-2c"),
    ],
)
def test_the_slug_names_the_cpu_kind(results, description, slug):
    fields, flags = description
    assert results.machine_slug({**fields, "flags": flags, "gpu": None}) == slug


@pytest.mark.parametrize(
    ("name", "count", "slug"),
    [
        ("NVIDIA H100 80GB HBM3", 1, "h100"),
        ("NVIDIA H100 80GB HBM3", 8, "h100x8"),
        ("NVIDIA A100-SXM4-80GB", 1, "a100"),
        ("NVIDIA GeForce RTX 4090", 2, "rtx4090x2"),
    ],
)
def test_the_slug_of_a_gpu_machine_is_the_gpu(results, name, count, slug):
    gpu = {"name": name, "count": count}
    assert results.machine_slug({"cpu_model": "x", "cores": 16, "gpu": gpu}) == slug


def test_paths_inside_the_checkout_are_written_relative(results):
    inside = str(results.ROOT / ".venv-vllm" / "bin" / "python")
    assert results.portable({"a": [inside, 3], "b": Path(inside)}) == {
        "a": [".venv-vllm/bin/python", 3],
        "b": ".venv-vllm/bin/python",
    }


def test_a_headline_that_cannot_be_read_is_empty_not_an_error(results, capsys):
    assert results.headline("trainer_speed", {"rows": []}) == {}
    assert "no headline for trainer_speed" in capsys.readouterr().err


def test_every_benchmark_writes_under_its_own_name_and_has_a_headline(results):
    headlines = importlib.import_module("headlines")
    writers = {}
    for script in sorted(BENCHMARKS.glob("*.py")):
        for name in re.findall(r"write_result\(\s*\"(\w+)\"", script.read_text()):
            writers[script.stem] = name
    assert len(writers) >= 16 and "engine_throughput" in writers  # the scan sees them
    assert all(stem == name for stem, name in writers.items()), writers
    assert set(writers) == set(headlines.PICKS)


def recorded(folder: Path, name: str, slug: str, date: str, value: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "trainer_speed",
        "date": date,
        "commit": {"sha": "0123456789abcdef", "dirty": False},
        "machine": {"slug": slug, "description": f"the {slug} machine"},
        "headline": {"MFU %": value},
        "figures": {},
    }
    (folder / name).write_text(json.dumps(record))


def test_the_table_shows_the_newest_file_of_each_machine_kind(table, tmp_path):
    folder = tmp_path / "results" / "trainer_speed"
    recorded(folder, "2026-01-01-kind-a.json", "kind-a", "2026-01-01T09:00:00Z", 10.0)
    recorded(folder, "2026-01-01-kind-a-9.json", "kind-a", "2026-01-01T09:00:00Z", 19.0)
    recorded(folder, "2026-01-01-kind-a-10.json", "kind-a", "2026-01-01T09:00:00Z", 20.0)
    recorded(folder, "2026-01-02-kind-b.json", "kind-b", "2026-01-02", 30.0)
    page = tmp_path / "results.md"
    assert table.main(["--results", str(tmp_path / "results"), "--out", str(page)]) == 0
    text = page.read_text()
    assert "Generated by `make bench-table`" in text
    rows = [line for line in text.splitlines() if line.startswith("| `kind-")]
    assert rows == [
        "| `kind-a` | the kind-a machine |",  # the machine kinds first
        "| `kind-b` | the kind-b machine |",
        # then the benchmark's rows, newest kind first; a day's tenth file after its ninth
        "| `kind-b` | 2026-01-02 | `0123456` | 30.0 | the script | `2026-01-02-kind-b.json` |",
        "| `kind-a` | 2026-01-01 | `0123456` | 20.0 | the script | `2026-01-01-kind-a-10.json` |",
    ]
