"""The LM head's log-probs, forward and backward, with its per-chunk passes compiled
(`trainer/fused_head.py`) or as eager ops, taking turns in one process.

The head of a training step at SmolLM2-135M's shape (hidden 576, vocabulary 49152):
`--rows` completion rows, bf16 autocast over float32 weights as the trainer runs on a
CPU with native bf16 (`--dtype float32` for CPUs without), log-probs and entropies
and both gradients. The matmuls are the same in both systems; only the passes over
each (512, V) chunk of logits differ. Prints the median seconds of each direction and
writes them with every repeat to a result file (and to `--out`, if given).

    .venv/bin/python benchmarks/head_passes.py --threads 2 --out /tmp/head_passes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from result_files import write_result  # benchmarks/ is on sys.path

from asyncgrpo.learning.trainer import fused_head
from asyncgrpo.learning.trainer.logprobs import lm_head_token_logprobs

SYSTEMS = {"eager": fused_head.eager_passes, "fused": nullcontext}


def one_pass(head, hidden, targets, weights, bf16: bool) -> tuple[float, float]:
    """Seconds of the forward and of the backward of one head call."""
    x = hidden.clone().requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    start = time.perf_counter()
    with autocast:
        logprobs, entropy = lm_head_token_logprobs(x, head, targets, with_entropy=True)
    middle = time.perf_counter()
    ((logprobs * weights).sum() + entropy.sum()).backward()
    end = time.perf_counter()
    head.weight.grad = None
    return middle - start, end - middle


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2560, help="completion rows (5 chunks)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = torch.nn.Linear(576, 49152, bias=False)
    hidden = torch.randn(args.rows, 576)
    targets = torch.randint(0, 49152, (args.rows,))
    weights = torch.randn(args.rows)
    bf16 = args.dtype == "bfloat16"
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in SYSTEMS}
    for repeat in range(args.repeats + 1):  # the first round warms up (and compiles)
        for name, passes in SYSTEMS.items():
            with passes():
                timing = one_pass(head, hidden, targets, weights, bf16)
            if repeat:
                seconds[name].append(timing)
    print(f"{args.rows} rows x 576 -> 49152, {args.dtype}, {args.threads} threads")
    print(f"{'system':8s} {'forward s':>10s} {'backward s':>11s} {'total s':>8s}")
    rows = {}
    for name, runs in seconds.items():
        forward = statistics.median(f for f, _ in runs)
        backward = statistics.median(b for _, b in runs)
        total = statistics.median(f + b for f, b in runs)
        rows[name] = {"forward_s": forward, "backward_s": backward, "total_s": total}
        print(f"{name:8s} {forward:10.3f} {backward:11.3f} {total:8.3f}")
    print(f"eager / fused total: {rows['eager']['total_s'] / rows['fused']['total_s']:.2f}x")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "runs": seconds}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")
    write_result("head_passes", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
