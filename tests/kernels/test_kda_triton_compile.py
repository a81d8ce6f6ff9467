"""Every Triton KDA kernel compiles for Hopper (sm_90) and fits its shared memory, checked without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepted a backward kernel the compiler rejects (a
loop-carried variable that changed shape) and knows no shared-memory limit (the state kernels asked for 416 KiB
at head dim 128): both surfaced on the first GPU. `tests/kernels/triton_compile.py` compiles each launch of
the forward, backward and decode paths with the real compiler (in a child process: this one may be interpreting;
started in the background as soon as the session's tests are selected).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED_LIMIT = {90: 232448, 80: 166912}
"""Bytes of shared memory one block may use: H100 / H200 (sm_90) and A100 (sm_80)."""
KERNELS = {"_chunk_prep_kernel", "_chunk_intra_kernel", "_chunk_ut_kernel", "_chunk_state_kernel",
           "_chunk_bwd_state_kernel", "_chunk_bwd_inter_kernel", "_chunk_bwd_ut_kernel", "_chunk_bwd_intra_kernel",
           "_chunk_bwd_final_kernel", "_recurrent_fwd_kernel"}


_RUNS: dict[tuple, tuple[subprocess.Popen, object]] = {}  # (arch, head_dim, dtype) -> (compile process, its output)


def start_compiles(items: list[pytest.Item], config: pytest.Config) -> None:
    """Start the compile processes of the selected tests in the background (`tests/kernels/conftest.py` calls this
    once the session's tests are selected), so that their seconds of compiling overlap the tests before them; any
    left when the session ends (interrupted, -x) are killed."""
    for item in items:
        if Path(str(item.path)).name == Path(__file__).name and hasattr(item, "callspec"):
            _start(*(item.callspec.params[k] for k in ("arch", "head_dim", "dtype")))
    config.add_cleanup(_stop_all)


def _stop_all() -> None:
    while _RUNS:
        proc, out = _RUNS.popitem()[1]
        proc.kill()
        proc.wait()
        out.close()


def _start(arch: int, head_dim: int, dtype: str) -> None:
    if (arch, head_dim, dtype) in _RUNS or importlib.util.find_spec("triton.backends.nvidia") is None:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "tests.kernels.triton_compile", "--arch", str(arch), "--head-dim",
                             str(head_dim), "--dtype", dtype], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    _RUNS[arch, head_dim, dtype] = proc, out


def _compile(arch: int, head_dim: int, dtype: str) -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    _start(arch, head_dim, dtype)  # already running when the conftest hook started it
    proc, out = _RUNS.pop((arch, head_dim, dtype))
    try:
        proc.wait(timeout=900)
    finally:
        proc.kill()
    out.seek(0)
    lines = out.read().splitlines()
    out.close()
    assert proc.returncode == 0, "\n".join(lines[-40:])
    return [json.loads(line) for line in lines if line.startswith("{")]


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
