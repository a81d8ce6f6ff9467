"""Benchmark (CUDA only): kimi_vl's Triton KDA kernels vs the torch path, transformers' fallback and fla.

Times, on the same inputs (default B=1, T=8192, H=16, D=128, bf16, ``use_qk_l2norm=True``, initial state):

* prefill forward and forward+backward (loss ``(o * do).sum() + (ht * dht).sum()``):
  ``kimi_vl`` Triton ``chunk_kda`` (Triton forward and backward kernels),
  ``kimi_vl`` torch ``chunk_kda_torch``, transformers' ``chunk_kimi_delta_attention`` and fla's
  ``chunk_kda`` (when ``fla`` is installed);
* decode, one token for ``--decode-batch`` sequences from a state: ``kimi_vl`` Triton
  ``fused_recurrent_kda`` vs ``fused_recurrent_kda_torch`` and fla's ``fused_recurrent_kda``.

Each time is the median of ``--repeats`` CUDA-event timed runs after warm-up (fewer, at least 3, for a path
whose forward and backward takes over half a second); ratios are printed against ours (targets: within 1.5x of
fla, >= 10x the torch path). Any implementation that fails (missing package,
out of memory) is reported and skipped. Exits with code 2 on a machine without CUDA.

Run: ``python bench/kda_gpu.py [--T 8192 --H 16 --D 128 --dtype bf16 --repeats 10 --decode-batch 32]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable


def _time_cuda(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` measured with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _impls() -> dict[str, tuple[Callable, Callable | None]]:
    """name -> (chunk fn(q, k, v, g, beta, h0) -> (o, ht), recurrent fn or None)."""
    from kimi_vl.kernels.kda import chunk_kda_torch, fused_recurrent_kda_torch
    from kimi_vl.kernels.kda_triton import chunk_kda_triton, fused_recurrent_kda_triton

    def ours(chunk: Callable, recurrent: Callable) -> tuple[Callable, Callable]:
        kw = dict(output_final_state=True, use_qk_l2norm=True)
        return (lambda q, k, v, g, b, h0: chunk(q, k, v, g, b, initial_state=h0, **kw),
                lambda q, k, v, g, b, h0: recurrent(q, k, v, g, b, initial_state=h0, **kw))

    impls: dict[str, tuple[Callable, Callable | None]] = {
        "kimi_vl triton": ours(chunk_kda_triton, fused_recurrent_kda_triton),
    }
    impls["kimi_vl torch"] = ours(chunk_kda_torch, fused_recurrent_kda_torch)
    try:
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

        impls["transformers fallback"] = (
            lambda q, k, v, g, b, h0: chunk_kimi_delta_attention(q, k, v, g, b, initial_state=h0,
                                                                 output_final_state=True,
                                                                 use_qk_l2norm_in_kernel=True),
            None,
        )
    except ImportError as err:
        print(f"[skip] transformers chunk_kimi_delta_attention: {err}")
    # fla last: its first call autotunes its kernels, and on an H200 it had not finished after 140 s, so a time
    # limit cuts it first
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
        from fla.ops.kda import fused_recurrent_kda as fla_recurrent

        impls["fla"] = (
            lambda q, k, v, g, b, h0: fla_chunk(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True),
            lambda q, k, v, g, b, h0: fla_recurrent(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True),
        )
    except ImportError as err:
        print(f"[skip] fla: {err}")
    return impls


def _inputs(B: int, T: int, H: int, D: int, dtype, seed: int = 0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = (rnd(B, T, H, D).to(dtype) for _ in range(3))
    g = F.logsigmoid(rnd(B, T, H, D)).to(dtype)
    beta = rnd(B, T, H).sigmoid().to(dtype)
    h0 = rnd(B, H, D, D)
    return [q, k, v, g, beta, h0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--decode-batch", type=int, default=32)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench/kda_gpu.py needs a CUDA GPU (the Triton kernels only run on CUDA here); none found.",
              file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    impls = _impls()
    print(f"device {torch.cuda.get_device_name()}; B={args.B} T={args.T} H={args.H} D={args.D} {args.dtype}, "
          f"median of {args.repeats}")

    tensors = _inputs(args.B, args.T, args.H, args.D, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(tensors[0].shape[:3] + (args.D,), generator=gen, device="cuda").to(dtype)
    dht = torch.randn(tensors[5].shape, generator=gen, device="cuda")
    dec = _inputs(args.decode_batch, 1, args.H, args.D, dtype, seed=2)  # decode: one token per sequence
    results: dict[str, dict[str, float]] = {}
    decode: dict[str, float] = {}
    ref_o = ref_grads = None
    for name, (chunk, recurrent) in impls.items():  # each one's prefill, then its decode
        leaves = [t.detach().clone().requires_grad_() for t in tensors]

        def fwd(chunk=chunk, leaves=leaves):
            with torch.no_grad():
                return chunk(*leaves)

        def fwd_bwd(chunk=chunk, leaves=leaves):
            for t in leaves:
                t.grad = None
            o, ht = chunk(*leaves)
            ((o.float() * do.float()).sum() + (ht.float() * dht).sum()).backward()

        try:
            o, _ = fwd()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fwd_bwd()
            torch.cuda.synchronize()
            # a slow path (transformers' fallback loops in Python) gets fewer repeats: about 10 s each at most
            repeats = max(3, min(args.repeats, int(5.0 / max(time.perf_counter() - t0, 1e-6))))
            grads = [t.grad.float() for t in leaves]
            diff = ""
            if ref_o is not None:  # agreement with ours: output, and the worst relative gradient error
                worst = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                            for a, b in zip(grads, ref_grads, strict=True))
                diff = f"  max|o - o_triton| {(o.float() - ref_o).abs().max().item():.2e}, grads rel {worst:.1e}"
            else:
                ref_o, ref_grads = o.float(), grads
            results[name] = dict(fwd=_time_cuda(fwd, repeats), fwd_bwd=_time_cuda(fwd_bwd, repeats))
            ours = results.get("kimi_vl triton")
            ratio = (f"  ({results[name]['fwd'] / ours['fwd']:.2f}x / {results[name]['fwd_bwd'] / ours['fwd_bwd']:.2f}x"
                     " ours)" if ours and name != "kimi_vl triton" else "")
            print(f"{name:24s} fwd {results[name]['fwd'] * 1e3:9.3f} ms   fwd+bwd "
                  f"{results[name]['fwd_bwd'] * 1e3:9.3f} ms{ratio}{diff}", flush=True)
        except Exception as err:  # noqa: BLE001 - report any backend failure and go on
            print(f"[fail] {name}: {type(err).__name__}: {err}")
        torch.cuda.empty_cache()
        if recurrent is None:
            continue
        try:
            with torch.no_grad():
                decode[name] = _time_cuda(lambda recurrent=recurrent: recurrent(*dec), args.repeats * 10)
            print(f"{name:24s} decode (B={args.decode_batch}, T=1) {decode[name] * 1e6:9.1f} us", flush=True)
        except Exception as err:  # noqa: BLE001
            print(f"[fail] {name} decode: {type(err).__name__}: {err}")

    ours = results.get("kimi_vl triton")
    if ours is None:
        print("SUMMARY our Triton chunk_kda failed")
        return 1
    print("SUMMARY ratios (time of other / time of ours; > 1 means ours is faster)")
    for name, r in results.items():
        if name == "kimi_vl triton":
            continue
        print(f"  vs {name:22s} fwd {r['fwd'] / ours['fwd']:7.2f}x   fwd+bwd {r['fwd_bwd'] / ours['fwd_bwd']:7.2f}x")
    for name, t in decode.items():
        if name != "kimi_vl triton" and "kimi_vl triton" in decode:
            print(f"  vs {name:22s} decode {t / decode['kimi_vl triton']:7.2f}x")
    if "kimi_vl torch" in results:
        r = results["kimi_vl torch"]["fwd_bwd"] / ours["fwd_bwd"]
        print(f"  target >= 10x the torch path (fwd+bwd): {r:.2f}x -> {'PASS' if r >= 10 else 'MISS'}")
    if "fla" in results:
        r = ours["fwd_bwd"] / results["fla"]["fwd_bwd"]
        print(f"  target within 1.5x of fla (fwd+bwd): ours/fla {r:.2f}x -> {'PASS' if r <= 1.5 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
