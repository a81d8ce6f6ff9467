#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one call on a lent machine (at most 9 minutes on an H100 / H200), from the
# repository root:
#   1. the Triton KDA kernels against the torch path on the GPU, every shape (slow-marked ones too)
#   2. bench/kda_gpu.py: their timings against the torch path, transformers' fallback and fla (when installed)
#   3. bench/gpu_train.py: the `small` preset's pre-training, SFT and RL for a few steps (bf16): step time,
#      tokens/s, peak memory
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

timeout "${KERNELS_S:-120}" python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
    tests/kernels/test_kda_triton.py 2>&1 | tee "$OUT/kernels.log"
timeout "${KDA_S:-180}" python3 bench/kda_gpu.py 2>&1 | tee "$OUT/kda_gpu.log"
tok=()
[ -d gpu/tok_small ] && tok=(--tokenizer gpu/tok_small)
timeout "${TRAIN_S:-220}" python3 bench/gpu_train.py --preset small --steps 20 --sft-steps 8 --rl-steps 2 \
    "${tok[@]}" --out /tmp/gpu_train 2>&1 | grep -v "find_unused_parameters" | tee "$OUT/gpu_train.log"
cp /tmp/gpu_train/gpu_train.json "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
