"""TRL's `GRPOTrainer` on the same recipe, for `end_to_end.py` to compare against.

It reads an asyncgrpo recipe and maps it onto `GRPOConfig` field by field (group
size, completion length, temperature, batch of completions per step, learning
rate and schedule, clipping, aggregation, reward scaling; no KL, one
optimizer step per generation batch, as asyncgrpo does; bf16 autocast when
the recipe's trainer uses it; gradient checkpointing off, TRL's best case for
a model this small). Held-out reward is
measured the way asyncgrpo measures it — greedy completions of the eval rows,
scored by the same reward functions — from a callback whose time is excluded
from the training clock. It writes `metrics.jsonl` in asyncgrpo's format, so
`asyncgrpo plot --compare` and `end_to_end.py` read all systems alike.

Needs the `trl` package (pinned in the `dev` extra, which `make` installs).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from asyncgrpo.base.config import RunConfig, load_config
from asyncgrpo.base.models import resolve_model
from asyncgrpo.learning.rollout.data import load_prompts, render_prompt
from asyncgrpo.learning.rollout.rewards import RewardRunner
from asyncgrpo.learning.trainer.checkpoint import copy_weights, write_weights


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--out", required=True, help="run directory to write")
    parser.add_argument("--budget-s", type=float, required=True, help="training wall-clock budget")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    return parser.parse_args(argv)


def grpo_config(cfg: RunConfig, out: Path, max_steps: int | None):
    """The recipe mapped onto TRL's `GRPOConfig`, field by field."""
    from trl import GRPOConfig

    completions_per_step = cfg.coordinator.batch_groups * cfg.rollout.num_generations
    return GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=cfg.trainer.use_bf16_autocast(),  # autocast on CPU, as asyncgrpo's trainer
        gradient_checkpointing=False,  # TRL turns it on; a 135M model does not need it
        seed=cfg.seed,
        max_steps=max_steps or 10**6,
        learning_rate=cfg.trainer.learning_rate,
        lr_scheduler_type=cfg.trainer.lr_schedule,
        warmup_steps=cfg.trainer.warmup_steps,
        max_grad_norm=cfg.trainer.max_grad_norm,
        weight_decay=cfg.trainer.weight_decay,
        per_device_train_batch_size=completions_per_step,
        num_generations=cfg.rollout.num_generations,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature or 1.0,
        top_p=cfg.rollout.top_p,
        beta=0.0,
        epsilon=cfg.loss.epsilon_low,
        epsilon_high=cfg.loss.epsilon_high,
        loss_type=cfg.loss.aggregation,
        scale_rewards=cfg.advantage.scale_rewards,
        reward_weights=cfg.advantage.reward_weights,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


class HeldOutReward:
    """The mean weighted reward of greedy completions of the eval rows, as asyncgrpo
    evaluates: the model generates in batches of 16 left-padded prompts, and each
    completion is scored by the recipe's reward functions."""

    def __init__(self, model, tokenizer, rows: list, reward_funcs: list, weights, max_tokens: int):
        self.model, self.tokenizer, self.rows = model, tokenizer, rows
        self.reward_funcs, self.weights, self.max_tokens = reward_funcs, weights, max_tokens

    @torch.no_grad()
    def __call__(self) -> float:
        self.model.eval()
        totals = []
        for start in range(0, len(self.rows), 16):
            rows = [dict(r) for r in self.rows[start : start + 16]]
            prompts = [render_prompt(self.tokenizer, r["prompt"]) for r in rows]
            width = max(map(len, prompts))
            pad = self.tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            generated = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=self.max_tokens,
                pad_token_id=pad,
            )[:, width:]
            for row, gen in zip(rows, generated.tolist(), strict=True):
                totals.append(self.score(row, gen))
        self.model.train()
        return float(sum(totals) / len(totals))

    def score(self, row: dict, gen: list[int]) -> float:
        """One completion's weighted reward, the reward functions called as TRL calls them."""
        text = self.tokenizer.decode(gen, skip_special_tokens=True)
        completion = (
            [{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text
        )
        columns = {k: [v] for k, v in row.items() if k != "prompt"}
        scores = [
            f(prompts=[row["prompt"]], completions=[completion], completion_ids=[gen], **columns)[0]
            for f in self.reward_funcs
        ]
        return sum(w * s for w, s in zip(self.weights, scores) if s is not None)


class Clock(TrainerCallback):
    """Training wall-clock without evaluation; stops the run when the budget is spent.

    Writes asyncgrpo's metric rows (`write`), evaluates every `eval_steps` and saves a
    snapshot every `save_every` steps (`snapshot`); both stay off the clock."""

    def __init__(
        self,
        start: float,
        budget_s: float,
        evaluate: Callable[[], float],
        write: Callable[[dict], None],
        eval_steps: int,
        save_every: int | None,
        snapshot: Callable[[int], None],
    ):
        self.start = start
        self.excluded = 0.0
        self.budget_s, self.evaluate, self.write = budget_s, evaluate, write
        self.eval_steps, self.save_every, self.snapshot = eval_steps, save_every, snapshot

    def elapsed(self) -> float:
        return time.monotonic() - self.start - self.excluded

    def eval_now(self, step: int) -> None:
        t0 = time.monotonic()
        reward = self.evaluate()
        self.excluded += time.monotonic() - t0
        self.write(
            {"kind": "eval", "step": step, "time_s": self.elapsed(), "eval_reward_mean": reward}
        )

    def on_train_begin(self, args, state, control, **kw):
        self.eval_now(0)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            reward = logs.get("reward", logs.get("rewards/mean"))
            self.write(
                {
                    "kind": "train",
                    "step": state.global_step,
                    "time_s": self.elapsed(),
                    "reward_mean": reward,
                    "loss": logs.get("loss"),
                    "grad_norm": logs.get("grad_norm"),
                    "learning_rate": logs.get("learning_rate"),
                    "entropy": logs.get("entropy"),
                    "completion_len_mean": logs.get("completions/mean_length"),
                    "clip_ratio": logs.get("clip_ratio/region_mean"),
                }
            )

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % self.eval_steps == 0:
            self.eval_now(state.global_step)
        every = self.save_every
        if every and state.global_step % every == 0:  # as asyncgrpo, but off the clock
            t0 = time.monotonic()
            self.snapshot(state.global_step)
            self.excluded += time.monotonic() - t0
        if self.elapsed() >= self.budget_s:
            control.should_training_stop = True


def load_model(cfg: RunConfig):
    """The recipe's model in float32 (TRL trains in it) and its tokenizer, which pads on
    the left for batched generation."""
    model_dir = str(resolve_model(cfg.model.name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def snapshot_writer(model, out: Path, dtype: torch.dtype) -> Callable[[int], None]:
    """Saves the model's weights at a step to `out/weights/step-NNNNNN.safetensors`."""

    def snapshot(step: int) -> None:
        (out / "weights").mkdir(exist_ok=True)
        # what asyncgrpo's snapshots hold: tied tensors once, in the engine's dtype
        write_weights(out / "weights" / f"step-{step:06d}.safetensors", copy_weights(model, dtype))

    return snapshot


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import datasets
    from trl import GRPOTrainer

    cfg = load_config(args.recipe, args.overrides)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(cfg)
    # Both systems' clocks start once the trainer's model is loaded: asyncgrpo's then
    # includes its engine process start-up and first weight sync, TRL's the building of
    # GRPOTrainer. Evaluation stays outside TRL's clock.
    process_start = time.monotonic()
    train_rows, eval_rows = load_prompts(cfg.dataset, cfg.seed)
    eval_rows = eval_rows[: cfg.eval_limit] if eval_rows else eval_rows  # as asyncgrpo evaluates
    runner = RewardRunner(list(cfg.rewards))
    reward_funcs = list(runner.funcs)
    weights = cfg.advantage.reward_weights or [1.0] * len(reward_funcs)
    evaluate = HeldOutReward(
        model, tokenizer, eval_rows, reward_funcs, weights, cfg.rollout.max_tokens
    )
    metrics_file = (out / "metrics.jsonl").open("w")

    def write(line: dict) -> None:
        metrics_file.write(json.dumps(line) + "\n")
        metrics_file.flush()

    snapshot = snapshot_writer(model, out, getattr(torch, cfg.engine.resolved_dtype()))
    clock = Clock(
        start=process_start,
        budget_s=args.budget_s,
        evaluate=evaluate,
        write=write,
        eval_steps=cfg.eval_steps,
        save_every=cfg.save_weights_steps,
        snapshot=snapshot,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=grpo_config(cfg, out, args.max_steps),
        train_dataset=datasets.Dataset.from_list([dict(r) for r in train_rows]),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    # the final weights, for scoring outside the run (benchmarks/end_to_end.py)
    write_weights(out / "final_model.safetensors", copy_weights(model))
    metrics_file.close()
    runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
