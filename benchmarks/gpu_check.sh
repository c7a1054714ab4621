#!/bin/bash
# The GPU checks in one short call, in the order that matters if time runs out: the GPU
# tests (the trainer's, then the paged KV cache's), then the trainer against the padded
# step on Qwen2.5-0.5B's shape, then attention alone. Run from the repository root on a
# machine with one CUDA GPU and torch, transformers and pytest installed; writes every
# table and JSON under $OUT (default ./gpu_out), the benchmarks' result files under
# $OUT/results/<benchmark>/ (copy them into benchmarks/results/ to keep them). The checks
# without the paged tests took about 4 minutes on an H100, start-up not counted; the paged
# tests compile FlexAttention for 8 variants and the paged runner's for a few shapes; they
# have not yet run on a GPU (their CPU variants have).
#
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#
# The device machines of this project lack a few pure-Python packages; wheels placed in
# .whl/ (git-ignored) are installed first when present.
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

timeout 150 python3 -m pytest -q -m gpu tests/integration/test_cuda_trainer.py \
    -p no:cacheprovider 2>&1 | tail -3
# the CUDA engine's parts: paged attention against the dense reference, IPC weight handover
timeout 240 python3 -m pytest -q -m gpu tests/unit/test_paged_cuda.py -p no:cacheprovider \
    2>&1 | tee "$OUT/paged_cuda.txt" | tail -5
# the paged runner on the GPU: the CPU's logits, the model's greedy argmax, the bf16 gap
timeout 240 python3 -m pytest -q -s -m gpu tests/unit/test_paged_runner_cuda.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/paged_runner_cuda.txt" | tail -8

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
