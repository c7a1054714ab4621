"""Does an abandoned Tinker session leave memory behind in `tinker-serve`?

A team's server outlives thousands of client programs, many of which exit without a
goodbye. This runs `tinker-serve` as its own process (a short `--session-ttl`) and, one
after another, N client processes that each do what a Tinker user does with the
unmodified `tinker` SDK (create `--models` LoRA models, train two steps on each, save a
state, save sampler weights and sample from them) and then exit without closing their
session. After each client the benchmark waits until the server has expired the session,
then reads the resident memory of the server and of its engine process.

The figure is the growth per session after warm-up: the least-squares slope of RSS
against the session's index over the last two thirds of the sessions, with its 95%
interval (the target is 0 beyond noise). Tables the server keeps bounded (finished
futures, ended sessions) still grow while they fill, so a small positive slope over a
short run is expected; it must not scale with what a session held (its models).

    .venv/bin/python benchmarks/tinker_session_memory.py --sessions 40 --models 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from asyncgrpo.testing import child_pids

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path, not run
    sys.path.append(str(Path(__file__).resolve().parent))
from result_files import write_result  # noqa: E402
from staleness_stats import t_quantile  # noqa: E402

KEY = "tml-session-memory-benchmark"


def client(url: str, model: str, index: int, models: int) -> None:
    """One user program: train, save and sample `models` models, then exit abruptly."""
    import tinker
    from tinker import types

    os.environ["TINKER_API_KEY"] = KEY
    service = tinker.ServiceClient(base_url=url)
    tokens = list(range(40, 60))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
            "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32)),
        },
    )
    for m in range(models):
        trainer = service.create_lora_training_client(base_model=model, rank=16, seed=index)
        for _ in range(2):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        trainer.save_state(f"s{index}-{m}").result()
        sampler = trainer.save_weights_and_get_sampling_client(name=f"w{index}-{m}")
        prompt = types.ModelInput.from_ints([40, 41, 42])
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=5)).result()
    os._exit(0)  # abandoned: no goodbye, the heartbeats stop


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith(name) and not ln.startswith("#")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def start_server(model: str, work: Path, ttl: float) -> tuple[subprocess.Popen, str]:
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "asyncgrpo.cli", "tinker-serve", "--model", model]
    command += ["--state-dir", str(work / "state"), "--port", str(port), "--dtype", "float32"]
    command += ["--session-ttl", str(ttl)]
    env = dict(os.environ, ASYNCGRPO_TINKER_API_KEY=KEY)
    log = (work / "tinker-serve.log").open("w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"tinker-serve exited: see {work / 'tinker-serve.log'}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("tinker-serve did not start in 5 minutes")


def slope(values: list[float]) -> dict:
    """Least-squares growth per session and its 95% interval (none from two points)."""
    y = np.asarray(values)
    x = np.arange(len(y), dtype=float)
    b, a = np.polyfit(x, y, 1)
    if len(y) < 3:
        return {"mib_per_session": b, "low": None, "high": None, "n": len(y)}
    resid = y - (a + b * x)
    se = float(np.sqrt(resid @ resid / (len(y) - 2) / ((x - x.mean()) ** 2).sum()))
    t = t_quantile(0.975, len(y) - 2)
    return {"mib_per_session": b, "low": b - t * se, "high": b + t * se, "n": len(y)}


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="session-memory-"))
    model = args.model
    if model == "tiny":
        from asyncgrpo.testing import save_tiny_model_dir

        model = str(save_tiny_model_dir(work / "tiny-model"))
    server, url = start_server(model, work, args.ttl)
    rows = []
    try:
        for index in range(args.sessions):
            command = [sys.executable, __file__, "--client", url, "--model", model]
            command += ["--index", str(index), "--models", str(args.models)]
            subprocess.run(command, check=True, capture_output=True, timeout=600)
            while metric(url, "asyncgrpo_tinker_sessions_live") > 0:
                time.sleep(0.5)
            time.sleep(1.0)  # the trainer thread releases the models after the expiry
            engine = sum(rss_mib(c) for c in child_pids(server.pid))
            rows.append({"server_mib": rss_mib(server.pid), "engine_mib": engine})
            print(f"session {index}: server {rows[-1]['server_mib']:.1f} MiB, "
                  f"engine {engine:.1f} MiB", flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
    warm = len(rows) // 3
    return {
        "sessions": args.sessions,
        "models_per_session": args.models,
        "warm_up_sessions": warm,
        "rows": rows,
        "server": slope([r["server_mib"] for r in rows[warm:]]),
        "engine": slope([r["engine_mib"] for r in rows[warm:]]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=40)
    p.add_argument("--models", type=int, default=2, help="LoRA models each client creates")
    p.add_argument("--model", default="tiny", help="tiny (random, built here) or a model name")
    p.add_argument("--ttl", type=float, default=3.0, help="tinker-serve --session-ttl")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        return client(args.client, args.model, args.index, args.models)
    figures = run(args)
    for who in ("server", "engine"):
        s = figures[who]
        band = f"[{s['low']:+.3f}, {s['high']:+.3f}] " if s["low"] is not None else ""
        print(f"{who}: {s['mib_per_session']:+.3f} MiB per session {band}over {s['n']} sessions")
    write_result("tinker_session_memory", figures, argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
