"""Training-step throughput of `KimiTextForCausalLM` against transformers' `KimiLinearForCausalLM`.

Same tiny config (hidden 256, 8 layers in the 3:1 hybrid, 8 experts top-2), same weights (ours is converted
from theirs), batch 4 x 512, fp32 on CPU, forward + backward + AdamW step. Prints tokens/s of each and the
ratio ours/theirs (target >= 2x).

    python bench/text_train.py [--threads 2] [--steps 3] [--batch 4] [--seq 512]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from common import TINY_TEXT, kimi_linear_pair, median_time


def step_fn(model: torch.nn.Module, ids: torch.Tensor) -> callable:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        theirs, ours = kimi_linear_pair(TINY_TEXT, tmp)
    ours.train()
    theirs.train()
    # transformers' MoE asserts nothing about training here, but its experts loop is the reference path.
    ids = torch.randint(3, 4096, (args.batch, args.seq))
    with torch.no_grad():
        diff = (ours(ids, use_cache=False).logits - theirs(ids, use_cache=False).logits).abs().max().item()
    tokens = args.batch * args.seq
    # Interleaved (ours, theirs, ours, ...) so that load from other processes hits both alike.
    step_ours, step_theirs = step_fn(ours, ids), step_fn(theirs, ids)
    step_ours(), step_theirs()  # warm-up
    runs_ours, runs_theirs = [], []
    for _ in range(args.steps):
        runs_ours.append(median_time(step_ours, 1, warmup=0))
        runs_theirs.append(median_time(step_theirs, 1, warmup=0))
    t_ours, t_theirs = statistics.median(runs_ours), statistics.median(runs_theirs)
    print(f"batch {args.batch} x {args.seq}, {args.threads} threads, fp32, max |logit diff| before training {diff:.2e}")
    print(f"transformers KimiLinearForCausalLM: {tokens / t_theirs:9.1f} tokens/s ({t_theirs:.2f} s/step)")
    print(f"kimi_vl KimiTextForCausalLM:        {tokens / t_ours:9.1f} tokens/s ({t_ours:.2f} s/step)")
    print(f"RATIO train tokens/s ours/transformers = {t_theirs / t_ours:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
