"""One `asyncgrpo serve` under hostile load: 512 concurrent clients, idle and slow connections.

Clients, one request each, all started at once (kinds in turn):

  chat-stream   a streaming chat completion (usage in its last chunk)
  complete-n4   /v1/completions with n = 4
  disconnect    a streaming chat completion that hangs up after its first chunk

Alongside, from a second before the clients until they are done (and at least
`--hold` seconds, so that the server's header and idle timeouts can show):

  idle          connections that connect and never send a byte
  slow-header   connections that send a request header one byte per second

Reports: answers by status (client-side errors by name), p50/p99 latency and
time to first token per kind, completion tokens/s over the run, the server's
resident memory (VmRSS) before, at its peak and after, how the idle and slow
connections ended, /health latency during the load, and how long the engine's
batch slots took to empty after the last client. Prints a table, writes
runs/benchmarks/server_load.json (`--out`; server log beside it) and a result file in
benchmarks/results/server_load/ (`result_files.py`).

  python benchmarks/server_load.py                                  # the full load
  python benchmarks/server_load.py --tiny --clients 16 --idle 10 --slow 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

KINDS = ("chat-stream", "complete-n4", "disconnect")
QUESTIONS = [
    "What is 17 + 25? Explain briefly.",
    "Tom has 12 apples and buys 7 more. How many apples does he have now?",
    "A box holds 9 pencils. How many pencils are in 6 boxes? Show your reasoning.",
    "Compute 81 - 38 and explain each step.",
]
SLOW_HEADER = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
)


@dataclass
class ClientResult:
    kind: str
    status: str  # "200", "503", "stream error 500", "ReadTimeout", ...
    latency: float
    ttft: float | None  # streaming kinds: seconds to the first chunk with a choice
    tokens: int  # completion tokens received


@dataclass
class ConnectionEnd:
    kind: str  # idle | slow-header
    how: str  # "closed by server", "open at end", "connect failed: ...", ...
    seconds: float  # from connect to close (or to the end of the run)
    answer: str = ""  # the first line the server sent, if any (e.g. a 408)


# ---- the clients ----


async def chat_stream(client: httpx.AsyncClient, i: int, args, hang_up: bool) -> ClientResult:
    kind = "disconnect" if hang_up else "chat-stream"
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    status, ttft, tokens = "200", None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return ClientResult(
                kind, str(response.status_code), time.perf_counter() - start, None, 0
            )
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                status = f"stream error {event['error'].get('code')}"
                break
            if event.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
                if hang_up:  # leaving the block unread closes the connection
                    return ClientResult(kind, status, ttft, ttft, 1)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ClientResult(kind, status, time.perf_counter() - start, ttft, tokens)


async def complete_n4(client: httpx.AsyncClient, i: int, args) -> ClientResult:
    body = {
        "model": "bench",
        "prompt": f"Question: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:",
        "n": 4,
        "max_tokens": args.max_tokens,
    }
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    latency = time.perf_counter() - start
    tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
    return ClientResult("complete-n4", str(response.status_code), latency, None, tokens)


async def one_client(client: httpx.AsyncClient, i: int, args) -> ClientResult:
    kind = KINDS[i % len(KINDS)]
    start = time.perf_counter()
    try:
        if kind == "complete-n4":
            return await complete_n4(client, i, args)
        return await chat_stream(client, i, args, hang_up=kind == "disconnect")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return ClientResult(kind, type(exc).__name__, time.perf_counter() - start, None, 0)


# ---- idle and slow-header connections ----


async def hold_connection(kind: str, port: int, stop: asyncio.Event, send: float | None):
    """Connect, then (if `send`) trickle SLOW_HEADER a byte per `send` seconds, until the
    server closes the connection or `stop` is set."""
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return ConnectionEnd(kind, f"connect failed: {type(exc).__name__}", 0.0)
    trickle = asyncio.ensure_future(_trickle(writer, send)) if send else None
    try:
        answer, closed = await _read_until_closed(reader, stop)
        how = "closed by server" if closed else "open at end"
    except (ConnectionError, OSError) as exc:
        answer, how = b"", f"reset: {type(exc).__name__}"
    finally:
        if trickle is not None:
            trickle.cancel()
        writer.close()
    first_line = answer.split(b"\r\n", 1)[0].decode("latin-1")
    return ConnectionEnd(kind, how, time.perf_counter() - start, first_line)


async def _trickle(writer: asyncio.StreamWriter, interval: float) -> None:
    try:
        for index in range(len(SLOW_HEADER)):
            writer.write(SLOW_HEADER[index : index + 1])
            await writer.drain()
            await asyncio.sleep(interval)
    except (ConnectionError, OSError):
        pass  # the server closed it: seen by the reader


async def _read_until_closed(reader: asyncio.StreamReader, stop: asyncio.Event):
    """(bytes received, whether the server closed the connection before `stop`)."""
    received = b""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while True:
            reading = asyncio.ensure_future(reader.read(4096))
            await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                reading.cancel()
                return received, False
            chunk = reading.result()
            if not chunk:
                return received, True
            received += chunk
    finally:
        stopping.cancel()


# ---- watching the server ----


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def sample_rss(pid: int, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_bytes(pid))
        await asyncio.sleep(0.5)


async def probe_health(base_url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /health once a second on a connection of its own; a failure counts as 30 s."""
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                ok = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start if ok else 30.0)
            await asyncio.sleep(1.0)


async def seconds_until_slots_free(base_url: str, token: str, timeout: float = 60.0):
    """After the clients: how long until the engine has no request running or waiting."""
    headers = {"authorization": f"Bearer {token}"}
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0, headers=headers) as client:
        while time.perf_counter() - start < timeout:
            try:
                stats = (await client.get("/server_info")).json()["stats"]
            except (httpx.HTTPError, ValueError, KeyError):
                return None
            if not any(stats.get(k) for k in ("running", "prefilling", "waiting")):
                return time.perf_counter() - start
            await asyncio.sleep(0.25)
    return None


# ---- one run ----


async def run_load(base_url: str, port: int, pid: int, token: str, args) -> dict:
    stop = asyncio.Event()
    rss_before, peak, health = rss_bytes(pid), [0], []
    watchers = [
        asyncio.ensure_future(sample_rss(pid, stop, peak)),
        asyncio.ensure_future(probe_health(base_url, stop, health)),
    ]
    held = [("idle", None)] * args.idle + [("slow-header", args.slow_interval)] * args.slow
    held = [asyncio.ensure_future(hold_connection(k, port, stop, send)) for k, send in held]
    held_since = time.perf_counter()
    await asyncio.sleep(1.0)  # idle and slow connections are in place before the clients come
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        clients = await asyncio.gather(*(one_client(client, i, args) for i in range(args.clients)))
        wall = time.perf_counter() - start
    slots_free = await seconds_until_slots_free(base_url, token)
    await asyncio.sleep(max(0.0, args.hold - (time.perf_counter() - held_since)))
    stop.set()
    ends = await asyncio.gather(*held)
    await asyncio.gather(*watchers)
    return {
        "clients": clients,
        "connections": ends,
        "wall_s": wall,
        "slots_free_after_s": slots_free,
        "health_s": health,
        "rss_before": rss_before,
        "rss_peak": max(peak[0], rss_bytes(pid)),
        "rss_after": rss_bytes(pid),
    }


# ---- the server ----


def serve_and_load(args, model_dir: str) -> dict:
    """Start `asyncgrpo serve` (an `EngineProcess`: free port, admin token, log), load it."""
    from asyncgrpo.base.config import EmbeddedEngineConfig
    from asyncgrpo.inference.engine.process import EngineProcess

    settings = dict(dtype="float32" if args.tiny else args.dtype, num_threads=args.threads)
    settings |= dict(served_model_name="bench", **dict(kv.split("=", 1) for kv in args.engine))
    proc = EngineProcess(
        EmbeddedEngineConfig(model=model_dir, **settings),
        log_path=Path(args.out).with_suffix(".log"),
    )
    with proc:
        proc.wait_ready(args.server_timeout)
        pid = proc.pid  # the server itself: `asyncgrpo serve` runs in this child
        run = asyncio.run(run_load(proc.base_url, proc.port, pid, proc.admin_token, args))
        run["server_alive_after"] = proc.alive()
    return run


# ---- report ----


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def kind_summary(results: list[ClientResult]) -> dict:
    ok = [r for r in results if r.status == "200"]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {
        "requests": len(results),
        "ok": len(ok),
        "statuses": dict(Counter(r.status for r in results)),
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "latency_p99_s": percentile([r.latency for r in ok], 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tokens": sum(r.tokens for r in results),
    }


def connection_summary(ends: list[ConnectionEnd], kind: str) -> dict:
    mine = [e for e in ends if e.kind == kind]
    closed = [e.seconds for e in mine if e.how == "closed by server"]
    return {
        "connections": len(mine),
        "ends": dict(Counter(e.how for e in mine)),
        "answers": dict(Counter(e.answer for e in mine if e.answer)),
        "closed_after_median_s": statistics.median(closed) if closed else None,
    }


def summarize(run: dict) -> dict:
    clients = run["clients"]
    kinds = {kind: kind_summary([r for r in clients if r.kind == kind]) for kind in KINDS}
    kinds["all"] = kind_summary(clients)
    tokens = kinds["all"]["tokens"]
    return {
        "kinds": kinds,
        "tokens_per_s": tokens / run["wall_s"],
        "wall_s": run["wall_s"],
        "rss_mb": {k: run[f"rss_{k}"] / 1e6 for k in ("before", "peak", "after")},
        "idle": connection_summary(run["connections"], "idle"),
        "slow_header": connection_summary(run["connections"], "slow-header"),
        "health_p50_s": percentile(run["health_s"], 50),
        "health_max_s": max(run["health_s"], default=None),
        "slots_free_after_s": run["slots_free_after_s"],
        "server_alive_after": run["server_alive_after"],
    }


def table(summary: dict) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [
        f"{'kind':<12} {'requests':>8} {'ok':>5} {'p50 s':>7} {'p99 s':>7} "
        f"{'ttft p50':>8} {'ttft p99':>8} {'tokens':>7}  statuses"
    ]
    for kind, k in summary["kinds"].items():
        lines.append(
            f"{kind:<12} {k['requests']:>8} {k['ok']:>5} {fmt(k['latency_p50_s']):>7} "
            f"{fmt(k['latency_p99_s']):>7} {fmt(k['ttft_p50_s']):>8} {fmt(k['ttft_p99_s']):>8} "
            f"{k['tokens']:>7}  {k['statuses']}"
        )
    rss = summary["rss_mb"]
    lines += [
        f"tokens/s: {summary['tokens_per_s']:.1f} over {summary['wall_s']:.1f}s",
        f"server RSS: {rss['before']:.0f} MB before, {rss['peak']:.0f} peak, {rss['after']:.0f} after",
        f"/health during load: p50 {fmt(summary['health_p50_s'])}s, max {fmt(summary['health_max_s'])}s",
        f"engine slots free {fmt(summary['slots_free_after_s'])}s after the last client",
    ]
    for name in ("idle", "slow_header"):
        c = summary[name]
        lines.append(
            f"{name}: {c['connections']} connections, ends {c['ends']}, answers {c['answers']}, "
            f"closed after {fmt(c['closed_after_median_s'])}s (median)"
        )
    if not summary["server_alive_after"]:
        lines.append("SERVER DIED during the load (see the server log beside the JSON)")
    return "\n".join(lines)


def model_directory(args, scratch: str) -> str:
    if args.tiny:
        from asyncgrpo.testing import save_tiny_model_dir

        return str(save_tiny_model_dir(Path(scratch) / "tiny-llama"))
    from asyncgrpo.base.models import resolve_model

    return str(resolve_model(args.model))


def raise_open_file_limit() -> None:
    """Hundreds of held connections need more descriptors than the usual soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=512, help="concurrent requests")
    parser.add_argument("--idle", type=int, default=300, help="idle connections alongside")
    parser.add_argument("--slow", type=int, default=100, help="slow-header connections alongside")
    parser.add_argument("--slow-interval", type=float, default=1.0, help="seconds per header byte")
    parser.add_argument(
        "--hold", type=float, default=15.0, help="hold idle/slow connections at least this long (s)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (and per sample)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory")
    parser.add_argument("--dtype", default="bfloat16", help="server --dtype (not with --tiny)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="server threads")
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an engine setting of the server (EmbeddedEngineConfig), e.g. max_num_seqs=128 (repeatable)",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, help="per client")
    parser.add_argument("--server-timeout", type=float, default=600.0, help="seconds to healthy")
    parser.add_argument("--out", default=str(SCRATCH / "server_load.json"))
    args = parser.parse_args(argv)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    raise_open_file_limit()
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-load-") as scratch:
        model_dir = model_directory(args, scratch)
        print(f"server on {model_dir}: {args.clients} clients, {args.idle} idle, {args.slow} slow")
        run = serve_and_load(args, model_dir)
    summary = summarize(run)
    print("\n" + table(summary))
    report = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "model_dir": model_dir,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "summary": summary,
        "clients": [asdict(r) for r in run["clients"]],
        "connections": [asdict(e) for e in run["connections"]],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    write_result("server_load", report, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
