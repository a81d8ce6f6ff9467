#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one call on a lent machine (at most 9.5 minutes on an H100 / H200, inside one
# call's 10), from the repository root, the most informative first (a time limit cuts the last):
#   1. bench/gpu_train.py: the `small` preset's pre-training, SFT and RL for a few steps (bf16): a STEP line per
#      step as it is logged (time, loss, peak memory), then step time, tokens/s, peak memory per stage
#   2. the `tiny` preset's first 20 pre-training steps through the kernels against the torch path (loss curves)
#   3. the `tiny` preset's pre-training for 4 steps under accelerate's FSDP2 path (one process), then the router's
#      fp32 scores under CUDA's bf16 autocast
#   4. bench/kda_gpu.py: the kernels' timings against the torch path, transformers' fallback and fla (when
#      installed; its first call autotunes for minutes, so it runs last)
#   5. the Triton KDA kernel tests on the GPU, every shape (slow-marked ones too), each test at most 60 s
# Packages the machine lacks travel as wheels in .whl/ (installed to /tmp/site first), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 \
#       -d .whl transformers==5.24.0 decord==0.6.0 flash-linear-attention==0.6.0 fla-core==0.6.0
# and a prebuilt tokenizer of the preset in gpu/tok_small skips its training. Logs go to $OUT (default runs/gpu).
set -uo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"

tok=()
[ -d gpu/tok_small ] && tok=(--tokenizer gpu/tok_small)
timeout "${TRAIN_S:-240}" python3 bench/gpu_train.py --preset small --steps 4 --skip 1 --sft-steps 2 --rl-steps 1 \
    "${tok[@]}" --out /tmp/gpu_train 2>&1 | grep -v -e "find_unused_parameters" -e "Liberation Sans" \
    | tee "$OUT/gpu_train.log"
cp /tmp/gpu_train/gpu_train.json "$OUT/" 2>/dev/null
# the `tiny` preset's first 20 pre-training steps in fp32, through the Triton kernels and through the torch path
for path in triton torch; do
    KIMI_VL_KERNELS=$path timeout "${PARITY_S:-45}" python3 -m kimi_vl.cli train pretrain --preset tiny --steps 20 \
        --precision no --no-progress --out "/tmp/parity_$path" 2>&1 | tail -1
done
python3 -c "from kimi_vl.training.trainer import read_metrics as r
a, b = (r(f'/tmp/parity_{p}/metrics.jsonl') for p in ('triton', 'torch'))
print('PARITY tiny pre-training, Triton vs torch path: max |loss difference| over', len(a), 'steps',
      max(abs(x['loss'] - y['loss']) for x, y in zip(a, b, strict=True)))" 2>&1 | tee "$OUT/parity.log"
# accelerate's FSDP2 path on the GPU (one process: DTensor parameters, whole-tensor checkpoints, the final gather);
# on CPUs the tests reach it only with accelerate's state switched to FSDP (tests/training/fsdp2_cpu.py)
timeout "${FSDP_S:-45}" accelerate launch --use_fsdp --fsdp_version 2 --num_processes 1 -m kimi_vl.cli train pretrain \
    --preset tiny --steps 4 --checkpoint-every 2 --no-progress --out /tmp/fsdp2 2>&1 | tail -2 | tee "$OUT/fsdp2.log"
# the fp32 router under CUDA's bf16 autocast: the same experts as without it
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/text/test_model.py -k autocast 2>&1 | tail -1 \
    | tee "$OUT/autocast.log"
timeout "${KDA_S:-100}" python3 bench/kda_gpu.py 2>&1 | tee "$OUT/kda_gpu.log"
timeout "${KERNELS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" --timeout 60 \
    tests/kernels/test_kda_triton.py 2>&1 | tee "$OUT/kernels.log"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
