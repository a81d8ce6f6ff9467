"""Compile every Triton KDA kernel for a CUDA architecture without a GPU, as launched for given shapes.

The Triton interpreter (how the CPU tests run the kernels) accepts programs the compiler rejects and knows no
shared-memory limit; this runs the real compiler. `chunk_kda_triton` (forward and backward) and
`fused_recurrent_kda_triton` run on CPU tensors with every kernel launch recorded instead of executed; each
distinct launch (kernel, argument types, constexprs, launch options) is then compiled with `triton.compile` for
the target, and one JSON line per launch gives its kernel name, the shared memory it needs, or the compiler's
error. Needs a triton with the NVIDIA backend (it bundles ptxas); no CUDA driver.

    python -m tests.kernels.triton_compile --arch 90 --head-dim 128 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    import torch

    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
             torch.int32: "i32", torch.int64: "i64"}
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    signature, constexprs = {}, {}
    for p in fn.params:
        value = bound.get(p.name, p.default)
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + types[value.dtype]
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(value).__name__}")
    return signature, constexprs


def compile_all(arch: int, head_dim: int, dtype: str, T: int = 200, H: int = 2) -> list[dict]:
    """One record per distinct launch: `kernel`, `shared` (bytes) or `error`."""
    import torch
    import torch.nn.functional as F
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kimi_vl.kernels import kda_triton

    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    for name in [n for n in dir(kda_triton) if n.endswith("_kernel")]:
        setattr(kda_triton, name, Recorder(getattr(kda_triton, name)))
    kda_triton._require_runnable = lambda x: None
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    # every constexpr variant: with an initial state, the final state and the L2 norm (one sequence); without
    # them (three packed sequences)
    for with_state, offsets in ((True, None), (False, [0, T // 3, T // 2, T])):
        q, k, v = (torch.randn(1, T, H, head_dim, dtype=dt, requires_grad=True) for _ in range(3))
        g = F.logsigmoid(torch.randn(1, T, H, head_dim)).to(dt).requires_grad_()
        beta = torch.rand(1, T, H, dtype=dt, requires_grad=True)
        h0 = torch.randn(1, H, head_dim, head_dim, requires_grad=True) if with_state else None
        kw = dict(initial_state=h0, output_final_state=with_state, use_qk_l2norm=with_state)
        o, ht = kda_triton.chunk_kda_triton(q, k, v, g, beta, offsets=offsets, **kw)
        (o.float().sum() + (ht.sum() if with_state else 0)).backward()
        with torch.no_grad():
            kda_triton.fused_recurrent_kda_triton(q, k, v, g, beta, offsets=offsets, **kw)
    records, seen = [], set()
    for fn, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        signature, constexprs = _signature(fn, args, kwargs)
        key = (fn.__name__, repr(signature), repr(constexprs), repr(options))
        if key in seen:
            continue
        seen.add(key)
        record = {"kernel": fn.__name__, "options": options}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                      options=options)
            record["shared"] = compiled.metadata.shared
        except Exception as err:  # noqa: BLE001 - reported to the test, which names the kernel
            record["error"] = f"{type(err).__name__}: {str(err)[-600:]}"
        records.append(record)
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100 / H200), 80 (A100)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels this compiles", file=sys.stderr)
        return 2
    for record in compile_all(args.arch, args.head_dim, args.dtype):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
