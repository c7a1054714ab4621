#!/bin/bash
# The GPU checks, in two parts that each fit one 10-minute call (a part's timeouts add up
# to 9 minutes), in the order that matters if time runs out. `engine` (the default): the
# paged KV cache's tests, the paged runner's, the whole engine on cuda (experimental:
# ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE=1), then the engine against transformers' generate
# and continuous batching, with a decode step against the device's limit (gpu_engine.py). `trainer`: the trainer's GPU tests, the
# trainer against the padded step on Qwen2.5-0.5B's shape, and attention alone (about 4
# minutes on an H100, start-up not counted). Nothing of the engine part has run on a GPU
# yet (its CPU variants have); it compiles FlexAttention for the paged tests' 8 variants
# and again for the runner's and the engine's shapes.
#
# Run from the repository root on a machine with one CUDA GPU and torch, transformers and
# pytest installed; writes every table and JSON under $OUT (default ./gpu_out), the
# benchmarks' result files under $OUT/results/<benchmark>/ (copy them into
# benchmarks/results/ to keep them).
#
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh [engine|trainer|all]
#
# The device machines of this project lack a few pure-Python packages:
# benchmarks/gpu_wheels.sh downloads them into .whl/ (git-ignored; carry it), installed
# here first when present.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >/dev/null 2>&1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-}
export ASYNCGRPO_RESULTS_DIR=${ASYNCGRPO_RESULTS_DIR:-$OUT/results}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
PART=${1:-engine}

engine_checks() {
# the CUDA engine's parts: paged attention against the dense reference, IPC weight handover
timeout 100 python3 -m pytest -q -m gpu tests/unit/test_paged_cuda.py -p no:cacheprovider \
    2>&1 | tee "$OUT/paged_cuda.txt" | tail -5
# the paged runner on the GPU: the CPU's logits, the model's greedy argmax, the bf16 gap
timeout 120 python3 -m pytest -q -s -m gpu tests/unit/test_paged_runner_cuda.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/paged_runner_cuda.txt" | tail -8
# the whole engine on cuda: the CPU engine's greedy tokens, before and after weight updates
ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE=1 timeout 100 python3 -m pytest -q -m gpu \
    tests/unit/test_engine_cuda.py -p no:cacheprovider 2>&1 | tail -8
# the engine against generate and continuous batching (nano, grpo256) on Qwen2.5-0.5B's
# shape, and its decode step against the limit; the JSON is rewritten after each phase
ASYNCGRPO_EXPERIMENTAL_CUDA_ENGINE=1 timeout 240 python3 benchmarks/gpu_engine.py \
    --out "$OUT/gpu_engine.json" 2>&1 | grep -v "^Loading\|^Writing" | tail -24
}

trainer_checks() {
timeout 150 python3 -m pytest -q -m gpu tests/integration/test_cuda_trainer.py \
    -p no:cacheprovider 2>&1 | tail -3

speed() {  # name, then trainer_speed.py arguments
    local name=$1
    shift
    timeout 90 python3 benchmarks/trainer_speed.py --device cuda --groups 32 --group-size 8 \
        --warmup 2 --steps 4 --out "$OUT/$name.json" "$@" 2>&1 | grep -v "^  step" | tail -3
}
speed qwen16k-varlen --shape qwen2.5-0.5b --micro-batch-tokens 16384 --attention varlen
speed qwen32k-varlen --shape qwen2.5-0.5b --micro-batch-tokens 32768 --attention varlen \
    --systems asyncgrpo
speed qwen16k-mask --shape qwen2.5-0.5b --micro-batch-tokens 16384 --attention mask \
    --systems asyncgrpo
timeout 60 python3 benchmarks/attention_probe.py --device cuda --out "$OUT/attention_probe.json"
}

case $PART in
    engine) engine_checks ;;
    trainer) trainer_checks ;;
    all) engine_checks && trainer_checks ;;
    *) echo "unknown part $PART: engine, trainer or all" >&2 && exit 2 ;;
esac
