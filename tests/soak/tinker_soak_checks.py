"""What the tinker-serve soak judges once its clients are done: the server's request log,
the clients' errors, the saved states and sampler weights, and the server's memory.

- The log (`--log-format json`: one object per request, `status`, `route`, `session`,
  `model`, `request_id`, a refusal's `refused` or `error`): no 5xx, and every refusal a
  client saw has its line.
- A client's error is expected only where the soak caused it: while the server was down
  and just after (connection errors, operations that died with it), or from a session
  the restart ended. Any other is a finding.
- Every saved state loads in a new session and its forward reproduces, bit for bit, the
  log-probs its client recorded right after saving it; every sampler's weights load and
  sample.
- Memory: per server process (a restart starts a new one), after its warm-up, the RSS
  range and its least-squares slope. Warm means a minute into its life and, for the
  server, once it has issued `KEEP_FINISHED` operations: until then its table of finished
  futures grows by design (a few KiB each), which a slope would take for a leak.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
from soak_support import MiB, slope

from asyncgrpo.tinker.futures import KEEP_FINISHED, boot_of

SERVER_GONE = "when tinker-serve stopped"  # what a future or session ended by a restart says
AFTER_RESTART_S = 60.0  # errors this long after a restart's health check are still its
VERIFY_CHUNK = 20  # saved states loaded per verifying session (each is a model in memory)


def request_lines(logs: list[Path]) -> list[dict]:
    """The per-request log lines of every server process, in order."""
    lines = []
    for log in logs:
        for text in log.read_text(errors="replace").splitlines():
            if not text.startswith("{"):
                continue  # a warning printed by a library, not a log record
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if "status" in record and "route" in record:
                lines.append(record)
    return lines


def log_records(logs: list[Path], level: str) -> list[dict]:
    """The service's own records (not request lines) at `level` ("error", "warning")."""
    found = []
    for log in logs:
        for text in log.read_text(errors="replace").splitlines():
            if text.startswith("{") and f'"level": "{level}"' in text and '"route"' not in text:
                found.append(json.loads(text))
    return found


def request_counts(lines: list[dict]) -> dict:
    by_status = Counter(str(line["status"]) for line in lines)
    by_route = Counter(f"{line['method']} {line['route']}" for line in lines)
    refused = sum(1 for line in lines if "refused" in line or "error" in line)
    return {
        "total": len(lines),
        "by_status": dict(by_status),
        "by_route": dict(by_route.most_common()),
        "refusals": refused,
    }


def unexpected_errors(errors: list[dict], outages: list[tuple[float, float]]) -> list[dict]:
    """The clients' errors the soak did not cause: outside every outage (the server's kill
    to `AFTER_RESTART_S` after it answered again) and not about a session it ended."""

    def caused(error: dict) -> bool:
        if SERVER_GONE in error["message"]:
            return True
        return any(down <= error["time"] <= up + AFTER_RESTART_S for down, up in outages)

    return [e for e in errors if not caused(e)]


def unlogged_refusals(errors: list[dict], lines: list[dict]) -> list[dict]:
    """The clients' refusals without a log line: a failed operation (it has a request id)
    needs a line of that id with its reason; a refused request (4xx), a line of that status
    whose reason the client's message contains. A connection error is no refusal."""
    reasons_by_id: dict[str, list[str]] = {}
    for line in lines:
        reason = line.get("refused") or line.get("error")
        if reason and line.get("request_id"):
            reasons_by_id.setdefault(line["request_id"], []).append(reason)
    refusals_by_status: dict[int, list[str]] = {}
    for line in lines:
        if 400 <= line["status"] < 500:
            refusals_by_status.setdefault(line["status"], []).append(line.get("refused", ""))
    missing = []
    for error in errors:
        if error.get("request_id") and error["type"] == "RequestFailedError":
            if not reasons_by_id.get(error["request_id"]):
                missing.append(error)
        elif error.get("status_code"):
            reasons = refusals_by_status.get(error["status_code"], [])
            if not any(reason[:60] in error["message"] for reason in reasons if reason):
                missing.append(error)
    return missing


def verify_saved(tinker, url: str, key: str, states: list[dict], weights: list[dict]) -> dict:
    """Load every saved state (its forward against the recorded log-probs) and every
    sampler's weights (one sample), in sessions of `VERIFY_CHUNK` loads, closed after."""
    from tinker_soak_client import PROBE, PROMPT, SAMPLING, datum

    mismatched, worst, same_tokens = [], 0.0, 0
    for start in range(0, len(states), VERIFY_CHUNK):
        chunk = states[start : start + VERIFY_CHUNK]
        with tinker.ServiceClient(base_url=url, api_key=key) as service:
            loading = [service.create_training_client_from_state(s["path"]) for s in chunk]
            trainers = [future.result(timeout=300) for future in loading]
            forwards = [t.forward([datum(PROBE)], "cross_entropy") for t in trainers]
            for saved, future in zip(chunk, forwards, strict=True):
                out = future.result(timeout=300).loss_fn_outputs[0]["logprobs"].to_numpy()
                expected = np.array(saved["logprobs"], dtype=np.float32)
                worst = max(worst, float(np.abs(out - expected).max()))
                if not np.array_equal(out, expected):
                    mismatched.append(saved["path"])
    for start in range(0, len(weights), VERIFY_CHUNK):
        chunk = weights[start : start + VERIFY_CHUNK]
        with tinker.ServiceClient(base_url=url, api_key=key) as service:
            prompt = tinker.types.ModelInput.from_ints(PROMPT)
            for saved in chunk:
                sampler = service.create_sampling_client(model_path=saved["path"])
                sampler = sampler.result(timeout=300)
                tokens = sampler.sample(prompt, 1, SAMPLING).result(timeout=300)
                same_tokens += list(tokens.sequences[0].tokens) == saved["tokens"]
    return {
        "states": len(states),
        "states_mismatched": mismatched,
        "states_max_abs_diff": worst,
        "sampler_weights": len(weights),
        "sampler_weights_same_tokens": same_tokens,
    }


def futures_full_at(log: Path) -> float | None:
    """When (`time.time()`) the server process of `log` had issued `KEEP_FINISHED`
    operations: from then on its table of finished futures, the largest of its bounded
    caches, holds as many as it ever will (None: it never got there)."""
    seen: set[str] = set()
    for line in request_lines([log]):
        request_id = line.get("request_id")
        if request_id and boot_of(request_id) is not None:
            seen.add(request_id)
            if len(seen) >= KEEP_FINISHED:
                return datetime.strptime(line["time"], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    return None


def rss_figures(
    samples: list[tuple[float, str, int, int]], warm_from: dict[int, float], warm_up_s: float
) -> list[dict]:
    """Per process (label and pid; a restarted server is a new one): its RSS range, in MiB,
    and the slope of a line fitted to its samples once warm, `warm_up_s` into its life or
    from `warm_from[pid]` (a time) if later; a downsampled series, (seconds, MiB)."""
    lives: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for t, label, pid, rss in samples:
        lives.setdefault((label, pid), []).append((t, rss / MiB))
    figures = []
    for (label, pid), points in lives.items():
        born = points[0][0]
        warm_at = max(born + warm_up_s, warm_from.get(pid, 0.0))
        warm = [(t, rss) for t, rss in points if t >= warm_at]
        figures.append(
            {
                "process": label,
                "pid": pid,
                "seconds": round(points[-1][0] - born, 1),
                "warm_after_s": round(warm_at - born, 1),
                "futures_full": pid in warm_from,
                "min_mib": round(min(rss for _, rss in points), 1),
                "max_mib": round(max(rss for _, rss in points), 1),
                "warm_samples": len(warm),
                "warm_first_mib": round(warm[0][1], 1) if warm else None,
                "warm_last_mib": round(warm[-1][1], 1) if warm else None,
                "warm_max_mib": round(max(r for _, r in warm), 1) if warm else None,
                "warm_slope_mib_per_min": round(slope(warm) * 60, 2) if len(warm) > 1 else None,
                "series": [(round(t - born), round(rss, 1)) for t, rss in points[::15]],
            }
        )
    return figures
