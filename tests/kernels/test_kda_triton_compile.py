"""Every Triton KDA kernel compiles for Hopper (sm_90) and fits its shared memory, checked without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepted a backward kernel the compiler rejects (a
loop-carried variable that changed shape) and knows no shared-memory limit (the state kernels asked for 416 KiB
at head dim 128): both surfaced on the first GPU. `tests/kernels/triton_compile.py` compiles each launch of
the forward, backward and decode paths with the real compiler (in a child process: this one may be interpreting).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED_LIMIT = {90: 232448, 80: 166912}
"""Bytes of shared memory one block may use: H100 / H200 (sm_90) and A100 (sm_80)."""
KERNELS = {"_chunk_prep_kernel", "_chunk_intra_kernel", "_chunk_ut_kernel", "_chunk_state_kernel",
           "_chunk_bwd_state_kernel", "_chunk_bwd_inter_kernel", "_chunk_bwd_ut_kernel", "_chunk_bwd_intra_kernel",
           "_chunk_bwd_final_kernel", "_recurrent_fwd_kernel"}


def _compile(arch: int, head_dim: int, dtype: str) -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.triton_compile", "--arch", str(arch), "--head-dim",
                           str(head_dim), "--dtype", dtype], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize(("arch", "head_dim", "dtype"), [
    (90, 64, "bf16"),  # the `small` preset's KDA heads
    pytest.param(90, 128, "bf16", marks=pytest.mark.slow),  # released Kimi-Linear's
    pytest.param(90, 128, "fp32", marks=pytest.mark.slow),
    pytest.param(80, 128, "bf16", marks=pytest.mark.slow),
])
def test_every_kernel_compiles_within_shared_memory(arch, head_dim, dtype):
    records = _compile(arch, head_dim, dtype)
    assert {r["kernel"] for r in records} == KERNELS  # forward, backward and decode all launched
    errors = [f"{r['kernel']}: {r['error']}" for r in records if "error" in r]
    assert not errors, "\n".join(errors)
    over = [(r["kernel"], r["shared"]) for r in records if r["shared"] > SHARED_LIMIT[arch]]
    assert not over, f"shared memory over the sm_{arch} limit of {SHARED_LIMIT[arch]} bytes: {over}"
    if arch == 90:  # the same launches fit an A100 too
        assert max(r["shared"] for r in records) <= SHARED_LIMIT[80]
