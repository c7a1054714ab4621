"""What a model brought back from disk costs on its first request, under
`tinker-serve --max-resident-models 1`.

With a bound of one and two LoRA models, every switch writes the idle model (adapter, Adam
moments, pending gradients) to a file under the state directory and reads the other back
before its operation runs (`asyncgrpo.tinker.offload`); a snapshot sampler whose weights a
newer step pushed out reads them back before it samples (`asyncgrpo.tinker.snapshots`).
This times the same request in both states through the unmodified `tinker` SDK against
tinker-serve's app (uvicorn on a thread, the engine its own process), in pairs:

- `forward_backward` of model A just after a step of model B sent A to disk ("reloaded"),
  against the same call with A in memory ("resident"); each is followed by A's
  `optim_step`, so that every timed call starts as a training loop's does, with no
  gradients pending;
- `sample` of a snapshot sampler of A whose weights a newer step sent to disk, against the
  same sample with them in memory; a sample of the base model just before each makes the
  engine hold other weights, so that both pay the engine's adapter switch and differ only
  by the reload.

The order inside a pair alternates. Per pair: reloaded / resident; the figures are the
medians (target: < 2). Beside each call, the seconds the service spent in
`ModelOffload.bring_in` or `SnapshotCache.use` during it (bringing the model or weights in,
sending others out) are summed: the rest of the difference is the call itself running
slower after the move (or noise). After the pairs, the phases of one offload and reload of A are
timed in process (copying its tensors, writing the file, unloading, reading, reloading;
peft's `add_adapter` alone, on a scratch adapter), to show where the extra time goes.

    .venv/bin/python benchmarks/tinker_offload.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from asyncgrpo.tinker.offload import write_tensors

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path, not run
    sys.path.append(str(Path(__file__).resolve().parent))
from result_files import SCRATCH, write_result  # noqa: E402
from tinker_overhead import KEY, start_server  # noqa: E402

CALLS = ("forward_backward", "sample")


class Stopwatch:
    """Wraps one object's method so that the seconds spent in it are summed (`taken`)."""

    def __init__(self, owner, name: str):
        self.method, self.taken = getattr(owner, name), 0.0
        setattr(owner, name, self)  # the instance's attribute shadows the class's method

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.taken += time.perf_counter() - start

    def lap(self) -> float:
        """The seconds taken since the last lap."""
        taken, self.taken = self.taken, 0.0
        return taken


PHASES = ("copy_s", "write_s", "unload_s", "read_s", "reload_s", "add_adapter_s")


class Program:
    """Two models, a snapshot sampler of the first and a base-model sampler, with what
    they send; `timed_fb` and `timed_sample` run a call on A or its snapshot and return its
    seconds, having checked (by the server's reload counters) the state it ran in."""

    def __init__(self, tinker, client, service, args):
        types = tinker.types
        self.service, self.args = service, args
        self.a, self.b = (
            client.create_lora_training_client(
                base_model=args.model, rank=args.rank, seed=s
            ).result()
            for s in (1, 2)
        )
        self.a_id = self.a.get_info().model_id
        rng = np.random.default_rng(0)
        vocab = service.served.vocab_size
        self.data = [
            datum(types, rng.integers(5, vocab, args.tokens + 1)) for _ in range(args.datums)
        ]
        self.adam = types.AdamParams(learning_rate=args.lr)
        self.params = types.SamplingParams(max_tokens=args.max_tokens, seed=7, temperature=1.0)
        self.prompt = types.ModelInput.from_ints(list(range(40, 40 + args.prompt_tokens)))
        self.snapshot = self.a.save_weights_and_get_sampling_client().result()
        self.base = client.create_sampling_client(base_model=args.model).result()
        # the time the service spends moving models and weights in and out, per call
        self.moving_models = Stopwatch(service.offload, "bring_in")
        self.moving_weights = Stopwatch(service.snapshots, "use")
        self.moved: dict[str, float] = {}

    def step(self, trainer) -> float:
        """forward_backward then optim_step; the forward_backward's seconds."""
        start = time.perf_counter()
        trainer.forward_backward(self.data, "cross_entropy").result()
        seconds = time.perf_counter() - start
        trainer.optim_step(self.adam).result()
        return seconds

    def sample(self, sampler) -> float:
        start = time.perf_counter()
        sampler.sample(self.prompt, self.args.samples, self.params).result()
        return time.perf_counter() - start

    def timed_fb(self, reloaded: bool) -> float:
        before = self.service.offload.reloads
        self.moving_models.lap()
        seconds = self.step(self.a)  # the optim_step brings nothing in: A is in memory
        self.moved["forward_backward"] = self.moving_models.lap()
        assert self.service.offload.reloads - before == reloaded, "A was not in the state timed"
        return seconds

    def timed_sample(self, reloaded: bool) -> float:
        if not reloaded:
            self.sample(self.snapshot)  # its weights back in memory, untimed
        self.sample(self.base)  # the engine switches to other weights
        before = self.service.snapshots.reloads
        self.moving_weights.lap()
        seconds = self.sample(self.snapshot)
        self.moved["sample"] = self.moving_weights.lap()
        moved = self.service.snapshots.reloads - before
        assert moved == reloaded, "the snapshot's weights were not in the state timed"
        return seconds


def datum(types, tokens: np.ndarray):
    """A cross-entropy datum: position i predicts tokens[i + 1], every position weighed."""
    inputs = {
        "target_tokens": types.TensorData.from_numpy(tokens[1:].astype(np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs
    )


def one_pair(program: Program, reloaded_first: bool) -> dict:
    """The four timed calls of a pair, and the seconds of each spent bringing its model or
    weights in (`..._moving_s`); `reloaded_first` says which state goes first. Model A is
    in memory when a pair starts (the pair before ended on it)."""
    p, times = program, {}

    def timed(call: str, reloaded: bool) -> None:
        key = f"{call}_{'reloaded' if reloaded else 'resident'}"
        timer = p.timed_fb if call == "forward_backward" else p.timed_sample
        times[key] = timer(reloaded)
        times[f"{key}_moving_s"] = p.moved[call]

    if reloaded_first:
        p.step(p.b)  # A (and the snapshot's weights) out
        timed("sample", True)
        timed("sample", False)
        timed("forward_backward", True)
        timed("forward_backward", False)
    else:
        timed("forward_backward", False)
        timed("sample", False)
        p.step(p.b)
        timed("sample", True)
        timed("forward_backward", True)
    return times


def offload_phases(service, model_id: str, repeats: int) -> list[dict]:
    """An offload and reload of `model_id` (in memory, idle), in steps, `repeats` times, as
    `ModelOffload` does them; and peft's `add_adapter` of a scratch adapter of its shape.
    The caller holds the models' lock, so that no operation runs in between."""
    models, rows = service.models, []
    path = service.offload.directory / "phases.safetensors"
    spec = models.spec(model_id)
    for _ in range(repeats):
        marks = [time.perf_counter()]
        tensors = models.memory_tensors(model_id)
        marks.append(time.perf_counter())
        write_tensors(path, tensors)
        marks.append(time.perf_counter())
        models.unload(model_id)
        marks.append(time.perf_counter())
        loaded = load_file(path)
        marks.append(time.perf_counter())
        models.reload(model_id, loaded)
        marks.append(time.perf_counter())
        models._add_adapter("phases_scratch", spec)
        marks.append(time.perf_counter())
        models.peft_model.delete_adapter("phases_scratch")
        row = {name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)}
        rows.append(row | {"file_bytes": path.stat().st_size})
        path.unlink()
    return rows


def measure(tinker, service, url, args) -> dict:
    with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
        program = Program(tinker, client, service, args)
        for _ in range(args.warmup):
            one_pair(program, True)
        pairs = [one_pair(program, n % 2 == 0) for n in range(args.pairs)]
        with service.models.lock:  # no operation runs meanwhile
            phases = offload_phases(service, program.a_id, args.phase_repeats)
        counts = {
            "model_offloads": service.offload.offloads,
            "model_reloads": service.offload.reloads,
            "snapshot_offloads": service.snapshots.offloads,
            "snapshot_reloads": service.snapshots.reloads,
        }
    return {"pairs": pairs, "phases": phases, "counts": counts}


def summarize(result: dict) -> dict:
    pairs, out = result["pairs"], {}
    for call in CALLS:
        ratios = [p[f"{call}_reloaded"] / p[f"{call}_resident"] for p in pairs]
        out[call] = {
            "pair_ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "median_reloaded_s": statistics.median(p[f"{call}_reloaded"] for p in pairs),
            "median_resident_s": statistics.median(p[f"{call}_resident"] for p in pairs),
            "median_extra_s": statistics.median(
                p[f"{call}_reloaded"] - p[f"{call}_resident"] for p in pairs
            ),
            # of a reloaded call: bringing its model or weights in (and others out)
            "median_moving_s": statistics.median(p[f"{call}_reloaded_moving_s"] for p in pairs),
        }
    out["phases_median_s"] = {
        name: statistics.median(row[name] for row in result["phases"]) for name in PHASES
    }
    out["model_file_mb"] = result["phases"][0]["file_bytes"] / 1e6 if result["phases"] else None
    return out


def report(result: dict, args, argv) -> None:
    summary = summarize(result)
    print(f"{'call':<18}{'resident s':>11}{'reloaded s':>11}{'moving s':>9}{'ratio':>7}  per pair")
    for call in CALLS:
        s = summary[call]
        pairs = " ".join(f"{r:.2f}" for r in s["pair_ratios"])
        print(
            f"{call:<18}{s['median_resident_s']:>11.3f}{s['median_reloaded_s']:>11.3f}"
            f"{s['median_moving_s']:>9.3f}{s['median_ratio']:>7.2f}  {pairs}"
        )
    phases = ", ".join(
        f"{k.removesuffix('_s')} {v:.3f}" for k, v in summary["phases_median_s"].items()
    )
    print(f"offload + reload of a model ({summary['model_file_mb']:.1f} MB file), s: {phases}")
    notes = (
        "Paired medians on a shared machine (other CPU-heavy work ran beside it): compare "
        "the ratios, not the seconds across runs. 'reloaded' = the call's model (or "
        "snapshot weights) was on disk and the other was in memory, so the call also wrote "
        "the other one out."
    )
    figures = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_average": os.getloadavg(),
        "notes": notes,
        "summary": summary,
    } | result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {args.out}")
    write_result("tinker_offload", figures, argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=6, help="measured pairs")
    parser.add_argument("--warmup", type=int, default=1, help="pairs run first, not measured")
    parser.add_argument("--datums", type=int, default=8, help="per forward_backward")
    parser.add_argument("--tokens", type=int, default=64, help="per datum")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--samples", type=int, default=4, help="per sample call")
    parser.add_argument("--max-tokens", type=int, default=16, help="per sample")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--phase-repeats", type=int, default=5)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=SCRATCH / "tinker_offload.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    torch.set_num_threads(args.trainer_threads)
    with tempfile.TemporaryDirectory() as state:
        service, server, url = start_server(args, Path(state), max_resident_models=1)
        try:
            result = measure(tinker, service, url, args)
        finally:
            server.should_exit = True
    report(result, args, argv)


if __name__ == "__main__":
    main()
