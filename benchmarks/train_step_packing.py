"""Training-step throughput and memory: padded vs packed vs packed + shared prompt.

One step = forward + backward of a token-mean of completion log-probs × random
per-sequence advantages, over a GRPO-shaped batch (groups of samples sharing a
prompt, heterogeneous completion lengths), in micro-batches planned by the same
token budget for every variant:

- padded: each micro-batch right-padded to (B, T) with an attention mask, stock
  sdpa (one sequence per row, as an ordinary HF forward);
- padded_logits (opt-in): the same, but the LM head over every position and a
  full log-softmax — what a naive trainer does;
- packed: one row per micro-batch, per-sequence sdpa segments (no padding);
- packed_shared: packed, with each group's prompt stored once (micro-batches
  planned with `groups=` so a group stays together when it fits the budget);
- packed_mask (opt-in): packed_shared layout through a dense (N, N) block mask.

All variants but padded_logits use the same fused LM head on completion rows
only, so padded vs packed isolates the layout. tokens/s counts real tokens
(prompt + completion of every sequence, as if unshared, no padding). Each
timed step runs in its own fresh subprocess (after a tiny warm-up step), and the
variants take turns, repeat by repeat, so drifts in machine load hit all alike;
the table shows the median step (tok/s = real tokens / median), the fastest
step (least disturbed by other load) and the median CPU time of the step
(all threads; less sensitive to a shared machine than wall time). "peak RSS" is that process's `ru_maxrss`
(weights, gradients and the step's activations; weights and gradients are the
same for every variant), max over repeats; "step Δ" is peak minus the RSS after
loading the model, i.e. what the training step added at its peak.

    .venv/bin/python benchmarks/train_step_packing.py   # 16 seqs = 2 groups x 8
    .venv/bin/python benchmarks/train_step_packing.py --groups 8 --completion-max 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from result_files import SCRATCH, write_result  # benchmarks/ is on sys.path

DEFAULT_VARIANTS = "padded,packed,packed_shared"
RESULTS = SCRATCH / "train_step_packing.json"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="name for asyncgrpo.base.models")
    ap.add_argument("--random", action="store_true", help="random SmolLM2-135M-shaped weights")
    ap.add_argument("--groups", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=96)
    ap.add_argument("--completion-min", type=int, default=8)
    ap.add_argument("--completion-max", type=int, default=128)
    ap.add_argument("--token-budget", type=int, default=2048, help="real tokens per micro-batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (processes) per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def smollm2_config():
    """SmolLM2-135M's architecture (the sizes of its config.json), for random weights."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )


def load_model(args):
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if not args.random:
        try:
            from asyncgrpo.base.models import resolve_model

            path = resolve_model(args.model)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return model, str(path)
        except (ImportError, ValueError) as err:
            print(f"[worker] {args.model} unavailable ({err}); random weights", file=sys.stderr)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(smollm2_config()), "random SmolLM2-135M config"


def make_batch(args, vocab: int):
    """GRPO-shaped batch: `groups` prompts × `group_size` completions of random ids."""
    rng = random.Random(args.seed)
    seqs, prompt_lengths, group_ids = [], [], []
    for g in range(args.groups):
        prompt = [
            rng.randrange(vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))
        ]
        for _ in range(args.group_size):
            n = rng.randint(args.completion_min, args.completion_max)
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(n)])
            prompt_lengths.append(len(prompt))
            group_ids.append(g)
    advantages = [rng.gauss(0.0, 1.0) for _ in seqs]
    return seqs, prompt_lengths, group_ids, advantages


def padded_logprobs(model, seqs, prompt_lengths, full_logits: bool):
    """Right-padded HF forward; log-probs of completion tokens per sequence."""
    import torch

    from asyncgrpo.learning.trainer.logprobs import lm_head_token_logprobs, selective_log_softmax

    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # (B, T)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # (B, T)
    rows = torch.tensor([b * width + t for b, (s, p) in enumerate(zip(seqs, prompt_lengths))
                         for t in range(p - 1, len(s) - 1)])  # fmt: skip
    targets = torch.tensor([t for s, p in zip(seqs, prompt_lengths) for t in s[p:]])
    counts = [len(s) - p for s, p in zip(seqs, prompt_lengths)]
    if full_logits:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # (B, T, V)
        logprobs = selective_log_softmax(logits.flatten(0, 1)[rows], targets)
    else:
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        hidden = hidden.last_hidden_state.flatten(0, 1)  # (B*T, H)
        logprobs, _ = lm_head_token_logprobs(hidden[rows], model.lm_head, targets)
    return list(logprobs.split(counts)), int(ids.numel())


def train_step(model, variant, batch, budget):
    """Forward + backward of the whole batch; returns tokens forwarded through the model."""
    from asyncgrpo.learning.trainer.packing import (
        pack_sequences,
        packed_token_logprobs,
        plan_micro_batches,
    )

    seqs, prompt_lengths, group_ids, advantages = batch
    total = sum(len(s) - p for s, p in zip(seqs, prompt_lengths))
    groups = group_ids if variant in ("packed_shared", "packed_mask") else None
    forwarded = 0
    for micro in plan_micro_batches([len(s) for s in seqs], budget, groups):
        mseqs = [seqs[i] for i in micro]
        mprompts = [prompt_lengths[i] for i in micro]
        if variant.startswith("padded"):
            logprobs, n = padded_logprobs(model, mseqs, mprompts, variant == "padded_logits")
        else:
            share = variant != "packed"
            attention = "mask" if variant == "packed_mask" else "segments"
            logprobs = packed_token_logprobs(
                model, mseqs, mprompts, share_prefix=share, attention=attention
            ).logprobs
            n = pack_sequences(mseqs, mprompts, share).input_ids.shape[1]
        forwarded += n
        loss = sum(lp.sum() * advantages[i] for lp, i in zip(logprobs, micro)) / total
        loss.backward()
    model.zero_grad(set_to_none=True)  # as the trainer does
    return forwarded


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_worker(args) -> dict:
    """One fresh process: load, a tiny warm-up step (kernels, grad buffers), one timed step."""
    import torch

    from asyncgrpo.learning.trainer.packing import enable_packed_attention

    torch.set_num_threads(args.threads)
    model, source = load_model(args)
    if args.worker.startswith("packed"):
        enable_packed_attention(model)
    model.train()
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())  # make mmap-loaded weights resident
    base_rss = rss_mb()
    seqs, prompts, groups, advantages = make_batch(args, model.config.vocab_size)
    tiny = [s[: p + 4] for s, p in zip(seqs[:2], prompts)], prompts[:2], groups[:2], advantages
    train_step(model, args.worker, tiny, args.token_budget)
    start, cpu_start = time.perf_counter(), time.process_time()
    forwarded = train_step(
        model, args.worker, (seqs, prompts, groups, advantages), args.token_budget
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return dict(
        model=source,
        real_tokens=sum(len(s) for s in seqs),
        forwarded_tokens=forwarded,
        step_s=elapsed,
        cpu_s=cpu,
        base_rss_mb=base_rss,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: kB
    )


def run_variant(argv: list[str], variant: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", variant]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(variant: str, runs: list[dict]) -> dict:
    median = statistics.median(r["step_s"] for r in runs)
    peak = max(r["peak_rss_mb"] for r in runs)
    base = statistics.median(r["base_rss_mb"] for r in runs)
    return dict(
        variant=variant,
        model=runs[0]["model"],
        real_tokens=runs[0]["real_tokens"],
        forwarded_tokens=runs[0]["forwarded_tokens"],
        step_times_s=[r["step_s"] for r in runs],
        cpu_times_s=[r["cpu_s"] for r in runs],
        median_s=median,
        min_s=min(r["step_s"] for r in runs),
        median_cpu_s=statistics.median(r["cpu_s"] for r in runs),
        tokens_per_s=runs[0]["real_tokens"] / median,
        base_rss_mb=base,
        peak_rss_mb=peak,
        step_delta_mb=peak - base,
    )


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r["variant"] == "padded"), results[0])
    print(
        f"{'variant':<14}{'fwd tok':>8}{'median s':>9}{'tok/s':>7}{'speedup':>8}"
        f"{'min s':>7}{'CPU s':>7}{'peak RSS MB':>12}{'step Δ MB':>10}"
    )
    for r in results:
        speedup = r["tokens_per_s"] / base["tokens_per_s"]
        print(
            f"{r['variant']:<14}{r['forwarded_tokens']:>8}{r['median_s']:>9.1f}"
            f"{r['tokens_per_s']:>7.1f}{speedup:>7.2f}x{r['min_s']:>7.1f}{r['median_cpu_s']:>7.1f}"
            f"{r['peak_rss_mb']:>12.0f}{r['step_delta_mb']:>10.0f}"
        )
    for r in results:
        if r is not base:
            paired = [b / t for b, t in zip(base["step_times_s"], r["step_times_s"], strict=True)]
            print(f"{r['variant']}: per-round speedup vs {base['variant']}: "
                  + ", ".join(f"{x:.2f}x" for x in paired))  # fmt: skip


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    load_before = os.getloadavg()
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):  # rotate variants so slow drifts in load hit all alike
        for variant in variants:
            runs[variant].append(run_variant(argv, variant))
            print(f"repeat {repeat} {variant}: {runs[variant][-1]['step_s']:.1f} s", flush=True)
    results = [summarize(v, runs[v]) for v in variants]
    print(f"real tokens per step: {results[0]['real_tokens']}  model: {results[0]['model']}")
    print_table(results)
    report = dict(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        results=results,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    write_result("train_step_packing", report, argv)


if __name__ == "__main__":
    main()
