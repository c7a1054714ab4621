"""The transformers systems `gpu_engine.py` measures the embedded engine against:
`model.generate` over padded batches, and transformers' continuous batching.

Continuous batching's API moves between transformers releases (written against 5.25, to
run on 5.17 too): the manager is started with `continuous_batching_context_manager`, given
only the keyword arguments its signature takes, and sized by a `ContinuousBatchingConfig`
where there is one (else by the same fields on the `GenerationConfig`, where older
releases read them). On a GPU it sizes its cache itself; on a CPU it is sized to the
workload (left to itself it takes a share of the machine's free memory, tens of GB).
Where the manager is missing, one `generate_batch` call is timed instead, its set-up
included and every request as long as the longest (recorded in `note`); without
`generate_batch` the system is `Unavailable`.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import math
import time

import torch
from ceiling import synchronize  # benchmarks/ is on sys.path


class Unavailable(RuntimeError):
    """This transformers has no such system; the reason is recorded instead of figures."""


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_model(args, model_dir):
    """The saved random model on `args.device` in `args.dtype`, its default attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=args.torch_dtype)
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as in every system
    torch.set_num_threads(args.threads)  # the embedded engine left the process at one
    return model


def sampling_config(max_new_tokens: int):
    """Temperature 1, top-k and top-p off, no EOS: what the embedded engine samples with."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


class GenerateSystem:
    """`model.generate` over left-padded batches of `--generate-batch-size` sequences (0:
    all at once), each batch generating its longest request's tokens."""

    def __init__(self, args, model_dir, works):
        self.args = args
        self.model = load_model(args, model_dir)
        self._generate([([5] * 8, 4), ([6] * 12, 4)])  # warm-up

    def _generate(self, rows: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # (B, T) left-padded
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(rows):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(m for _, m in rows)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.args.device),
                attention_mask=mask.to(self.args.device),
                generation_config=sampling_config(longest),
            )
        if out.shape[1] - width != longest:
            raise RuntimeError(f"generate stopped after {out.shape[1] - width} of {longest}")

    def run(self, work) -> dict:
        rows = work.rows()
        size = self.args.generate_batch_size or len(rows)
        synchronize(torch.device(self.args.device))
        start = time.perf_counter()
        for first in range(0, len(rows), size):
            self._generate(rows[first : first + size])
        synchronize(torch.device(self.args.device))
        seconds = time.perf_counter() - start
        return {"tokens": sum(m for _, m in rows), "seconds": seconds}

    def close(self) -> None:
        self.model = None


def _accepted(fn, **kwargs) -> dict:
    """The keyword arguments `fn` takes, of these."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def cache_sizing(args, rows: list[tuple[list[int], int]], generation) -> dict:
    """Keyword arguments that size continuous batching's cache: none on a GPU (it sizes
    itself from free memory), the workload's pages on a CPU."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None  # noqa: N806 (older releases: GenerationConfig fields)
    sizing = {}
    if torch.device(args.device).type == "cpu":
        page = 256  # transformers' default page size, where the config has none
        if ContinuousBatchingConfig is not None:
            page = getattr(ContinuousBatchingConfig(), "page_size", None) or page
        pages = sum(math.ceil((len(p) + m) / page) for p, m in rows)
        sizing = {"num_blocks": pages + len(rows) + 8, "max_batch_tokens": 1024}
    if ContinuousBatchingConfig is None:
        for name, value in sizing.items():
            setattr(generation, name, value)
        return {}
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    config = ContinuousBatchingConfig(**{k: v for k, v in sizing.items() if k in fields})
    return {"continuous_batching_config": config}


class ContinuousSystem:
    """transformers' continuous batching: per workload a manager is started and warmed up
    (untimed), then every sequence is added with its own length and the clock runs until
    the last finishes."""

    def __init__(self, args, model_dir, works):
        self.args = args
        self.model = load_model(args, model_dir)
        if not hasattr(self.model, "generate_batch"):
            import transformers

            raise Unavailable(f"transformers {transformers.__version__} has no generate_batch")

    def run(self, work) -> dict:
        rows = work.rows()
        generation = sampling_config(max(m for _, m in rows))
        sizing = cache_sizing(self.args, rows, generation)
        if not has_manager(self.model):
            return self._one_batch(rows, generation, sizing)
        manage = self.model.continuous_batching_context_manager
        kwargs = _accepted(manage, generation_config=generation, block=True, timeout=30, **sizing)
        device = torch.device(self.args.device)
        with manage(**kwargs) as manager:
            synchronize(device)
            start = time.perf_counter()
            ids = [manager.add_request(input_ids=p, max_new_tokens=m) for p, m in rows]
            if None in ids:
                raise RuntimeError("the manager refused some requests (add_request gave None)")
            outputs = _collect(manager, ids, self.args.system_timeout)
            synchronize(device)
            seconds = time.perf_counter() - start
        failed = [o.error for o in outputs.values() if getattr(o, "error", None)]
        if failed or len(outputs) < len(rows):
            raise RuntimeError(f"{len(outputs)} of {len(rows)} finished; errors {failed[:3]}")
        wanted = dict(zip(ids, (m for _, m in rows), strict=True))
        tokens = sum(min(len(o.generated_tokens), wanted[i]) for i, o in outputs.items())
        return {"tokens": tokens, "seconds": seconds}

    def _one_batch(self, rows, generation, sizing: dict) -> dict:
        """Older releases: one `generate_batch` call, set-up included, every request
        generating the longest's tokens (the requested ones are counted)."""
        generate_batch = self.model.generate_batch
        kwargs = _accepted(
            generate_batch, generation_config=generation, progress_bar=False, **sizing
        )
        device = torch.device(self.args.device)
        synchronize(device)
        start = time.perf_counter()
        outputs = generate_batch([p for p, _ in rows], **kwargs)
        synchronize(device)
        seconds = time.perf_counter() - start
        longest = max(m for _, m in rows)
        made = [len(o.generated_tokens) for o in outputs.values()]
        if len(made) < len(rows) or min(made) < longest:
            raise RuntimeError(f"generate_batch: {len(made)} of {len(rows)}, fewest {min(made)}")
        note = "generate_batch: set-up timed, every request as long as the longest"
        return {"tokens": sum(m for _, m in rows), "seconds": seconds, "note": note}

    def close(self) -> None:
        self.model = None


def has_manager(model) -> bool:
    """Whether this transformers starts a continuous batching manager in a `with`."""
    return hasattr(model, "continuous_batching_context_manager")


def _collect(manager, ids: list[str], timeout: float) -> dict:
    """The finished output of every request id, waiting at most `timeout` seconds."""
    outputs, deadline = {}, time.monotonic() + timeout
    while len(outputs) < len(ids) and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is None:
            if not getattr(manager, "is_running", lambda: True)():
                break
            continue
        if _finished(result):
            outputs[result.request_id] = result
    return outputs


def _finished(result) -> bool:
    """Whether an output is its request's last (releases without `is_finished` compare
    the status's name)."""
    if hasattr(result, "is_finished"):
        return result.is_finished()
    return getattr(result.status, "name", str(result.status)) in ("FINISHED", "FAILED")
