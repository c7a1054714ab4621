"""Costs from a data sheet: a model's size and a device's FLOP and bandwidth figures.

For hardware nobody here has run on, the planner's linear laws (`costs.py`) follow from
the usual roofline reading of a transformer in bf16, with the efficiencies stated as
inputs rather than hidden:

- a decode step of an engine (`tp` devices) reads the weights once and every running
  sequence's KV cache: `step_floor_s + weight_bytes / BW` fixed, `kv_bytes_per_token / BW`
  per context token, with `BW = tp * hbm_tb_s * bandwidth_util`; each sequence's token
  also costs `2 * params` FLOPs at `flop_util` of the engine's peak;
- a prefill token costs `2 * params` FLOPs, a trained token `train_flops_per_param_token *
  params` (6, or 8 with activation recomputation), a log-prob forward `2 * params`, all
  at `flop_util` of one rank's peak;
- a weight sync moves `weight_bytes` at `sync_gb_per_s`.

`step_floor_s` is what a step costs besides reading memory (kernel launches, the
sampler, the scheduler); data sheets do not give it, so it is an input like the rest.
"""

from __future__ import annotations

from asyncgrpo.plan.errors import PlanInputError

DEVICE_FIELDS = {
    "params_b": "parameters, billions",
    "kv_bytes_per_token": "KV cache bytes per token (layers * kv_heads * head_dim * 2 * 2)",
    "hbm_tb_s": "one device's memory bandwidth, TB/s",
    "bf16_tflops": "one device's dense bf16 peak, TFLOP/s",
    "tp": "devices per engine (tensor parallel)",
    "bandwidth_util": "fraction of the bandwidth a decode step reaches",
    "flop_util": "fraction of the peak reached by prefill, training and log-prob passes",
    "step_floor_s": "a decode step's cost besides memory traffic",
    "train_flops_per_param_token": "6, or 8 with activation recomputation",
    "sync_gb_per_s": "weight-sync bandwidth, GB/s",
}
DEFAULTS = {"tp": 1, "train_flops_per_param_token": 6, "step_floor_s": 0.0}


def costs_from_device(spec: dict) -> dict[str, float]:
    """The `Costs` fields that follow from a `device:` mapping (see the module docstring)."""
    unknown = set(spec) - DEVICE_FIELDS.keys()
    if unknown:
        raise PlanInputError(f"device: unknown field(s) {sorted(unknown)}")
    d = {**DEFAULTS, **{k: float(v) for k, v in spec.items()}}
    missing = DEVICE_FIELDS.keys() - d.keys() - {"sync_gb_per_s"}
    if missing:
        raise PlanInputError(f"device: give {sorted(missing)}")
    params = d["params_b"] * 1e9
    weight_bytes = 2 * params  # bf16
    bandwidth = d["tp"] * d["hbm_tb_s"] * 1e12 * d["bandwidth_util"]  # bytes/s, one engine
    engine_flops = d["tp"] * d["bf16_tflops"] * 1e12 * d["flop_util"]
    rank_flops = d["bf16_tflops"] * 1e12 * d["flop_util"]
    out = {
        "decode_base_s": d["step_floor_s"] + weight_bytes / bandwidth,
        "decode_per_ctx_s": d["kv_bytes_per_token"] / bandwidth,
        "decode_per_seq_s": 2 * params / engine_flops,
        "prefill_per_token_s": 2 * params / engine_flops,
        "train_per_token_s": d["train_flops_per_param_token"] * params / rank_flops,
        "logprob_per_token_s": 2 * params / rank_flops,
    }
    if "sync_gb_per_s" in d:
        out["sync_transfer_s"] = weight_bytes / (d["sync_gb_per_s"] * 1e9)
    return out
