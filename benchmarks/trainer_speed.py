"""Trainer speed against the machine's ceiling: asyncgrpo's training step beside a padded
transformers step (the way TRL's GRPOTrainer computes it), on the same GRPO batch.

Both systems train the same random-weight model (one copy each, same initial values) on
the same batches: `--groups` prompts of `--prompt-len` tokens, `--group-size` completions
each, completion lengths uniform in [`--completion-min`, `--completion-max`] (GRPO's
lengths vary several-fold). One step is forward + backward of the policy-gradient loss
over the whole batch in micro-batches, gradient clipping and an AdamW step, in fp32
weights under bf16 autocast where the trainer would use it (`trainer.bf16_autocast:
auto`), ending when the device's work is done.

- `asyncgrpo`: the trainer `asyncgrpo train` builds (`trainer.build.policy_trainer`):
  packed rows, each group's prompt once, the LM head on completion rows only, micro-
  batches of `--micro-batch-tokens` real tokens.
- `eager-head`: `asyncgrpo` with the LM head's per-chunk passes as eager ops instead of
  compiled ones (`trainer/fused_head.py`), on its own copy of the model: an A/B of them.
- `eager-layers`: `asyncgrpo` with its decoder layers eager (`trainer.compile_layers:
  false`) instead of compiled where `auto` compiles them (`trainer/compiled_layers.py`),
  on its own copy of the model: an A/B of the compilation.
- `other-autocast`: `asyncgrpo` with `trainer.bf16_autocast` the other way round from the
  one `--autocast` resolves to, on its own copy of the model: an A/B of the dtype choice.
- `padded`: TRL's computation: prompts left-padded and completions right-padded to the
  micro-batch's longest, an attention mask, `logits_to_keep` = the completion width,
  log-softmax of the kept logits, the token-mean loss. Micro-batches hold as many
  sequences as fit the same token budget at the longest length.

The ceiling is measured in the same run: a plain matmul of the model's largest linear
layer at a micro-batch's rows, in the compute dtype (`matmul TFLOP/s`), and a large
square one (`peak`). `mfu` is the batch's minimal work over the step time over the
model-shape matmul rate. Minimal work counts each group's prompt once, the prefix that
every prompt begins with (`--shared-prefix`, a system prompt) once in all, and no
padding (so both systems are measured against the same FLOPs, and sharing or padding
never inflates it): 6 FLOPs per linear weight per input token, the LM head's 6·V·d for
each row that predicts a completion token, and attention's 12·d_q per (query, key) pair
of the causal context, per layer. Tokens/s counts every sequence's prompt and completion
tokens, as a user reads a batch.

Steps alternate between the systems (after warm-ups) so drifts in machine load hit both;
the table shows medians.

    .venv/bin/python benchmarks/trainer_speed.py --threads 2            # SmolLM2-135M shape
    python benchmarks/trainer_speed.py --shape qwen2.5-0.5b --device cuda \\
        --groups 32 --group-size 8 --micro-batch-tokens 16384          # one GPU
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from ceiling import head_dim, linear_weights, matmul_tflops, synchronize  # benchmarks/ on sys.path
from result_files import SCRATCH, write_result

RESULTS = SCRATCH / "trainer_speed.json"
SYSTEMS = ("asyncgrpo", "padded")


def add_batch_arguments(ap, shape="smollm2-135m", micro_batch_tokens=4096, groups=4) -> None:
    """The model shape, device and GRPO batch options (`make_groups`), shared with
    `attention_probe.py`."""
    ap.add_argument("--shape", choices=["smollm2-135m", "qwen2.5-0.5b", "tiny"], default=shape)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    ap.add_argument("--micro-batch-tokens", type=int, default=micro_batch_tokens)
    ap.add_argument("--groups", type=int, default=groups)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="the first this many prompt tokens are the same in every group (a system prompt)",
    )
    ap.add_argument("--completion-min", type=int, default=32)
    ap.add_argument("--completion-max", type=int, default=256)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_batch_arguments(ap)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--attention", choices=["auto", "segments", "varlen", "mask"], default="auto")
    ap.add_argument(
        "--autocast", choices=["auto", "on", "off"], default="auto", help="trainer.bf16_autocast"
    )
    ap.add_argument("--steps", type=int, default=4, help="timed steps per system")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per system first")
    ap.add_argument(
        "--no-huge-pages",
        action="store_true",
        help="leave tensors off transparent huge pages (`asyncgrpo train` puts a CPU "
        "trainer's on them: `trainer.reuse_freed_memory`)",
    )
    ap.add_argument("--profile", type=Path, help="write a profile of one asyncgrpo step here")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def model_config(shape: str):
    """The architecture of a named model (its config.json's sizes), for random weights."""
    from transformers import LlamaConfig, Qwen2Config

    if shape == "qwen2.5-0.5b":
        return Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        )
    if shape == "tiny":
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    from train_step_packing import smollm2_config  # benchmarks/ is on sys.path

    return smollm2_config()


def make_groups(args, vocab: int, seed: int):
    """GRPO-shaped groups of random tokens: one prompt per group, completions of uniformly
    spread lengths, rewards that vary inside each group."""
    from asyncgrpo.learning.rollout.types import Group, Rollout

    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(min(args.shared_prefix, args.prompt_len))]
    groups = []
    for g in range(args.groups):
        prompt = shared + [rng.randrange(vocab) for _ in range(args.prompt_len - len(shared))]
        rollouts = []
        for i in range(args.group_size):
            n = rng.randint(args.completion_min, args.completion_max)
            completion = [rng.randrange(vocab) for _ in range(n)]
            rollouts.append(
                Rollout(prompt, completion, [-2.0] * n, [0] * n, "stop", "", [float(i % 2)])
            )
        groups.append(Group(g, {}, rollouts))
    return groups


def minimal_flops(model, groups, shared_prefix: int = 0) -> float:
    """The FLOPs a training step on `groups` needs at least (module docstring); the
    `shared_prefix` tokens that begin every prompt count once."""
    cfg = model.config
    body, head = linear_weights(cfg)
    q_dim = cfg.num_attention_heads * head_dim(cfg)
    repeats = max(0, len(groups) - 1) * shared_prefix
    inputs = -repeats
    pairs = -(repeats * (shared_prefix + 1) // 2)
    head_rows = 0
    for group in groups:
        prompt = len(group.rollouts[0].prompt_ids)
        inputs += prompt
        pairs += prompt * (prompt + 1) // 2
        for r in group.rollouts:
            completion = len(r.completion_ids)
            inputs += completion - 1  # the last token predicts nothing
            head_rows += completion
            pairs += sum(prompt + j for j in range(1, completion))
    return 6 * body * inputs + 6 * head * head_rows + 12 * cfg.num_hidden_layers * q_dim * pairs


def group_advantages(groups) -> list[list[float]]:
    """GRPO's advantages: each reward less its group's mean, over the group's std."""
    out = []
    for g in groups:
        rewards = torch.tensor([r.rewards[0] for r in g.rollouts])
        out.append(((rewards - rewards.mean()) / (rewards.std() + 1e-4)).tolist())
    return out


class PaddedTrainer:
    """TRL GRPOTrainer's training computation, written plainly on a transformers model."""

    def __init__(self, model, device: torch.device, bf16: bool, sequences_per_micro: int):
        self.model = model.to(device)
        self.device = device
        self.bf16 = bf16
        self.sequences_per_micro = sequences_per_micro
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(self, groups) -> float:
        seqs = [
            (r.prompt_ids, r.completion_ids, adv)
            for g, advs in zip(groups, group_advantages(groups), strict=True)
            for r, adv in zip(g.rollouts, advs, strict=True)
        ]
        total_tokens = sum(len(c) for _, c, _ in seqs)
        for start in range(0, len(seqs), self.sequences_per_micro):
            loss = self._micro_loss(seqs[start : start + self.sequences_per_micro], total_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def _micro_loss(self, seqs, total_tokens: int) -> torch.Tensor:
        width_p = max(len(p) for p, _, _ in seqs)
        width_c = max(len(c) for _, c, _ in seqs)
        ids = torch.zeros(len(seqs), width_p + width_c, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, (prompt, completion, _) in enumerate(seqs):
            ids[i, width_p - len(prompt) : width_p] = torch.tensor(prompt)  # left-padded
            ids[i, width_p : width_p + len(completion)] = torch.tensor(completion)
            attention[i, width_p - len(prompt) : width_p + len(completion)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        targets = ids[:, width_p:]  # (B, C)
        completion_mask = attention[:, width_p:].float()  # (B, C)
        advantages = torch.tensor([a for _, _, a in seqs], device=self.device)  # (B,)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16)
        with autocast if self.bf16 else nullcontext():
            out = self.model(input_ids=ids, attention_mask=attention, logits_to_keep=width_c + 1)
        logits = out.logits[:, :-1].float()  # (B, C, V): the rows that predict the completion
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        ratio = torch.exp(logprobs - logprobs.detach())  # on-policy: 1, with the gradient
        per_token = -ratio * advantages.unsqueeze(1)  # (B, C)
        return (per_token * completion_mask).sum() / total_tokens


def asyncgrpo_trainer(args, model, compile_layers: bool | str = "auto"):
    """The one-process trainer `asyncgrpo train` builds for these settings."""
    from asyncgrpo.base.config import RunConfig
    from asyncgrpo.learning.trainer.build import policy_trainer, prepare_policy

    cfg = RunConfig(
        name="trainer-speed",
        model={"name_or_path": "random"},
        trainer={
            "device": args.device,
            "num_threads": args.threads,
            "attention": args.attention,
            "bf16_autocast": {"auto": "auto", "on": True, "off": False}[args.autocast],
            "micro_batch_tokens": args.micro_batch_tokens,
            "compile_layers": compile_layers,
            "learning_rate": 1e-6,
        },
        rollout={"max_tokens": args.completion_max},
        rewards=["asyncgrpo.testing.even_token_reward"],
    )
    return policy_trainer(cfg, prepare_policy(cfg, model)), cfg.trainer


def build_systems(args, device: torch.device):
    """{name: step function} for the systems asked, and the model (for its sizes)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(args.shape), dtype=torch.float32)
    names = args.systems.split(",")
    padded_model = copy.deepcopy(model) if "padded" in names else None
    eager_model = copy.deepcopy(model) if "eager-head" in names else None
    other_model = copy.deepcopy(model) if "other-autocast" in names else None
    eager_layers_model = copy.deepcopy(model) if "eager-layers" in names else None
    trainer, trainer_cfg = asyncgrpo_trainer(args, model)
    bf16 = trainer_cfg.use_bf16_autocast(device.type)
    steps = {}
    if "asyncgrpo" in names:
        steps["asyncgrpo"] = trainer.step
    if eager_model is not None:
        steps["eager-head"] = with_eager_head(asyncgrpo_trainer(args, eager_model)[0].step)
    if eager_layers_model is not None:
        steps["eager-layers"] = asyncgrpo_trainer(args, eager_layers_model, False)[0].step
    if other_model is not None:
        other = argparse.Namespace(**vars(args) | {"autocast": "off" if bf16 else "on"})
        steps["other-autocast"] = asyncgrpo_trainer(other, other_model)[0].step
    if padded_model is not None:
        per_micro = max(1, args.micro_batch_tokens // (args.prompt_len + args.completion_max))
        steps["padded"] = PaddedTrainer(padded_model, device, bf16, per_micro).step
    return steps, trainer, bf16


def with_eager_head(step):
    """`step` with the LM head's passes as eager ops (`trainer/fused_head.py`)."""
    from asyncgrpo.learning.trainer import fused_head

    def eager_step(groups):
        with fused_head.eager_passes():
            return step(groups)

    return eager_step


def time_systems(args, steps, vocab: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each system, the systems taking turns on the same batches."""
    for w in range(args.warmup):
        for step in steps.values():
            step(make_groups(args, vocab, 10_000 + w))
    seconds = {name: [] for name in steps}
    for k in range(args.steps):
        groups = make_groups(args, vocab, k)
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            step(groups)
            synchronize(device)
            seconds[name].append(time.perf_counter() - start)
            print(f"  step {k}: {name} {seconds[name][-1]:.3f} s", flush=True)
    return seconds


def write_profile(path: Path, step, groups, device: torch.device) -> None:
    """torch.profiler's operator tables for one step, sorted by the device's own time: by
    operator, then by operator and input shapes (which tensors the copies are)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step(groups)
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    by_op = prof.key_averages().table(sort_by=key, row_limit=40)
    by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=60)
    path.write_text(f"{by_op}\n\nBy input shape:\n{by_shape}")
    print(f"wrote {path}")


def ceilings(args, model, bf16: bool, device: torch.device) -> dict[str, float]:
    """The device's matmul rates: the model's largest linear at a micro-batch's rows, and a
    large square product, in the dtype the trainer multiplies in."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = model.config
    rows = min(args.micro_batch_tokens, 8192)
    square = 8192 if device.type == "cuda" else 4096
    return {
        "matmul_shape": f"{rows}x{cfg.hidden_size}x{cfg.intermediate_size} {dtype}",
        "matmul_tflops": matmul_tflops(rows, cfg.hidden_size, cfg.intermediate_size, dtype, device),
        "peak_tflops": matmul_tflops(square, square, square, dtype, device, repeats=5),
    }


def summarise(args, seconds, model, ceiling, vocab: int) -> list[dict]:
    """One row per system: median step, tokens/s, achieved TFLOP/s and MFU."""
    flops, tokens = [], []
    for k in range(args.steps):
        groups = make_groups(args, vocab, k)
        flops.append(minimal_flops(model, groups, args.shared_prefix))
        tokens.append(
            sum(len(r.prompt_ids) + len(r.completion_ids) for g in groups for r in g.rollouts)
        )
    rows = []
    for name, times in seconds.items():
        step = statistics.median(times)
        tflops = statistics.median(f / t / 1e12 for f, t in zip(flops, times, strict=True))
        rows.append(
            {
                "system": name,
                "step_s": step,
                "tokens_per_s": statistics.median(
                    n / t for n, t in zip(tokens, times, strict=True)
                ),
                "tflops": tflops,
                "mfu": tflops / ceiling["matmul_tflops"],
                "mfu_of_peak": tflops / ceiling["peak_tflops"],
            }
        )
    return rows


def print_table(args, rows, ceiling, device_name: str) -> None:
    print(
        f"\n{args.shape} on {device_name}: {args.groups}x{args.group_size} sequences, prompt "
        f"{args.prompt_len}, completions {args.completion_min}-{args.completion_max}; matmul "
        f"{ceiling['matmul_shape']} {ceiling['matmul_tflops']:.2f} TFLOP/s, peak "
        f"{ceiling['peak_tflops']:.2f}"
    )
    padded = next((r["step_s"] for r in rows if r["system"] == "padded"), None)
    print(
        f"{'system':<14} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'mfu':>6} {'of peak':>8} {'vs padded':>10}"
    )
    for r in rows:
        ratio = f"{padded / r['step_s']:.2f}x" if padded else "-"
        print(
            f"{r['system']:<14} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.3f} "
            f"{r['mfu']:>6.1%} {r['mfu_of_peak']:>8.1%} {ratio:>10}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU here")
    if args.device == "cpu" and not args.no_huge_pages:
        from asyncgrpo.base.hardware import huge_pages_for_large_tensors

        print(f"huge pages for large tensors: {huge_pages_for_large_tensors()}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    device_name = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {args.threads} threads"
    )
    steps, trainer, bf16 = build_systems(args, device)
    vocab = trainer.model.config.vocab_size
    ceiling = ceilings(args, trainer.model, bf16, device)
    seconds = time_systems(args, steps, vocab, device)
    rows = summarise(args, seconds, trainer.model, ceiling, vocab)
    print_table(args, rows, ceiling, f"{device_name}, attention {trainer.attention}")
    if args.profile and "asyncgrpo" in steps:
        write_profile(args.profile, steps["asyncgrpo"], make_groups(args, vocab, 0), device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device_name}
    record["attention"] = trainer.attention
    record |= {"bf16_autocast": bf16, "ceiling": ceiling, "rows": rows, "step_seconds": seconds}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    write_result("trainer_speed", record, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
