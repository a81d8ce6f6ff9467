"""Benchmark: ``kimi_vl.kernels.chunk_kda`` vs transformers' torch ``chunk_kimi_delta_attention``.

Forward + backward on the same fp32 inputs (default B=1, H=4, T=4096, D=64, ``use_qk_l2norm=True``,
2 CPU threads), loss = ``(o * do).sum()``. With ``--docs L`` the T tokens are packed documents of random lengths
1..2L-1 (mean about L; the tiny preset's pre-training batches hold documents of about 70 tokens): ours is one call
with ``cu_seqlens``, transformers' (whose torch path has no varlen) one call per document.

Method (each implementation runs in its own fresh ``spawn`` subprocess, so neither sees the other's
allocations; ours then transformers' in each of ``--rounds`` rounds, so a drift of the machine's pace reaches both
alike; the ratios are taken within each round and printed as median [min, max]):

* memory: the peak resident memory (``VmHWM``) is read after the inputs are built (baseline) and
  after the first forward+backward; the difference is the peak extra resident memory of one training step.
  The peak after all timed repeats is printed too (the allocator may fragment over repeats).
* time: median wall time of ``--repeats`` forward+backward runs after that first (warm-up) run.
* accuracy: output and input gradients of the first run are sent back and compared as
  ``max|ours - theirs| / max|theirs|``.

Run: ``python bench/kda.py [--T 4096 --H 4 --D 64 --threads 2 --repeats 3 --rounds 3]``; the pre-training
layer's shapes: ``python bench/kda.py --T 1024 --H 8 --D 16 --docs 70 --repeats 20``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import peak_rss_mib, run_isolated, spread

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def _inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.T, args.H, args.D)
    q, k, v, g_raw = (torch.randn(shape, generator=gen) for _ in range(4))
    g = F.logsigmoid(g_raw)
    beta = torch.randn(shape[:3], generator=gen).sigmoid()
    do = torch.randn(shape, generator=gen)
    return [q, k, v, g, beta, do]


def _offsets(args: argparse.Namespace) -> list[int]:
    """Document boundaries ``[0, ..., T]``: one document without ``--docs``."""
    if not args.docs:
        return [0, args.T]
    gen = torch.Generator().manual_seed(1)
    offsets = [0]
    while offsets[-1] < args.T:
        length = int(torch.randint(1, 2 * args.docs, (1,), generator=gen))
        offsets.append(min(args.T, offsets[-1] + length))
    return offsets


def _worker(impl: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(args.threads)
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    from kimi_vl.kernels import chunk_kda

    *tensors, do = _inputs(args)
    leaves = [t.requires_grad_() for t in tensors]
    offsets = _offsets(args)
    cu_seqlens = torch.tensor(offsets) if args.docs else None

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        if impl == "ours":
            o, _ = chunk_kda(*leaves, use_qk_l2norm=True, cu_seqlens=cu_seqlens)
        else:
            o = torch.cat([chunk_kimi_delta_attention(*(t[:, a:b] for t in leaves), use_qk_l2norm_in_kernel=True)[0]
                           for a, b in zip(offsets[:-1], offsets[1:])], 1)
        (o * do).sum().backward()
        return o.detach()

    base = peak_rss_mib()
    o = step()
    peak_first = peak_rss_mib() - base
    results = [t.numpy().copy() for t in [o] + [t.grad for t in leaves]]  # numpy: plain pickling
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_all = peak_rss_mib() - base
    queue.put(dict(time=statistics.median(times), peak_mb=peak_first, peak_all_mb=peak_all, results=results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--docs", type=int, default=0, help="mean document length of packed documents (0: one)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run of each implementation")
    args = parser.parse_args()
    docs = f", {len(_offsets(args)) - 1} packed documents" if args.docs else ""
    print(f"chunk_kda fwd+bwd, B=1 T={args.T} H={args.H} D={args.D} fp32{docs}, threads={args.threads}, "
          f"median of {args.repeats}, {args.rounds} interleaved rounds")

    speeds, mems = [], []
    for n in range(args.rounds):
        ours, theirs = run_isolated(_worker, "ours", args), run_isolated(_worker, "transformers", args)
        for name, r in (("kimi_vl chunk_kda", ours), ("transformers chunk_kimi_delta_attention", theirs)):
            print(f"round {n + 1}: {name:42s} time {r['time'] * 1e3:9.1f} ms   peak {r['peak_mb']:8.1f} MiB "
                  f"(after all repeats {r['peak_all_mb']:8.1f} MiB)", flush=True)
        speeds.append(theirs["time"] / ours["time"])
        mems.append(ours["peak_mb"] / theirs["peak_mb"])
    pairs = zip(NAMES, ours["results"], theirs["results"], strict=True)
    diffs = {n: float(abs(a - b).max() / abs(b).max()) for n, a, b in pairs}
    print("max relative difference (max|ours-theirs| / max|theirs|): "
          + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
    speed, mem = spread(speeds, "x"), spread(mems, "x", digits=3)
    if args.docs:  # the targets below are the dense long-sequence case's
        print(f"SUMMARY speed ratio (theirs/ours) {speed}, peak memory ratio (ours/theirs) {mem}, "
              f"output max rel diff {diffs['o']:.1e} (median [min, max] over {args.rounds} rounds)")
        return
    ok = statistics.median(speeds) >= 4 and statistics.median(mems) <= 0.25 and diffs["o"] <= 1e-4
    print(f"SUMMARY speed ratio (theirs/ours) {speed} [target >= 4x], "
          f"peak memory ratio (ours/theirs) {mem} [target <= 0.25x], "
          f"output max rel diff {diffs['o']:.1e} [<= 1e-4] -> {'PASS' if ok else 'MISS'} "
          f"(median [min, max] over {args.rounds} rounds)")


if __name__ == "__main__":
    main()
