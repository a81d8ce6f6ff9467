"""Memory of the training loss: `chunked_causal_lm_loss` (what the trainer's forwards use above
`LOSS_CHUNK_ELEMENTS` logits) against `causal_lm_loss` of the full logits, on the LM head alone.

The last hidden states `[1, tokens, hidden]` go through an LM head over `--vocab` tokens and the next-token
cross-entropy, forward and backward, fp32 on the CPU. Each variant runs in its own subprocess (peak memory =
peak-RSS growth over the first forward and backward; time = the median of `--steps` after it), the two one after
the other in each of `--rounds` rounds. Prints each round's figures, then the chunked loss's peak memory and time as
ratios to the full loss, median [min, max] over the rounds. The small preset's micro-batch is 16384 tokens over a
32768-token vocabulary; Kimi's own vocabulary has 163840 tokens.

    python bench/loss_memory.py [--tokens 16384] [--hidden 768] [--vocab 32768] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
from common import median_time, peak_rss_mib, run_isolated, spread

from kimi_vl.text.modeling import LOSS_CHUNK_ELEMENTS, causal_lm_loss, chunked_causal_lm_loss


def _worker(variant: str, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(1, args.tokens, args.hidden, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.tokens))

    def step() -> float:
        if variant == "full":
            loss = causal_lm_loss(head(hidden), labels)
        else:
            loss = chunked_causal_lm_loss(hidden, head, labels)
        loss.backward()
        hidden.grad = head.weight.grad = None
        return loss.detach().item()

    before = peak_rss_mib()
    loss = step()
    peak = peak_rss_mib() - before
    queue.put({"peak_mib": peak, "seconds": median_time(step, args.steps, warmup=0), "loss": loss})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    chunk = max(1, LOSS_CHUNK_ELEMENTS // args.vocab)
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}: {-(-args.tokens // chunk)} chunks of "
          f"{chunk} tokens; fp32, {args.threads} threads")
    memory, time = [], []
    for r in range(args.rounds):
        full = run_isolated(_worker, "full", args)
        chunked = run_isolated(_worker, "chunked", args)
        if abs(full["loss"] - chunked["loss"]) > 1e-4 * abs(full["loss"]):
            raise SystemExit(f"the losses differ: {full['loss']} and {chunked['loss']}")
        memory.append(chunked["peak_mib"] / full["peak_mib"])
        time.append(chunked["seconds"] / full["seconds"])
        print(f"round {r + 1}: full {full['peak_mib']:.0f} MiB, {full['seconds']:.2f} s; chunked "
              f"{chunked['peak_mib']:.0f} MiB, {chunked['seconds']:.2f} s", flush=True)
    print(f"chunked / full: peak memory {spread(memory, 'x')}, time {spread(time, 'x')}")


if __name__ == "__main__":
    main()
