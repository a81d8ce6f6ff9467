"""Token efficiency of MuonClip against AdamW on the tiny LM and the embedded text corpus.

1. Learning rates are tuned on `--tune-seed` (the seed of the model's initialisation; every seed reads the same
   batches), never one of the evaluated seeds 0..`--seeds`-1: a 3-point sweep (WSD schedule), extended by factors
   of 3 while the best rate sits at an edge of the grid; the best final validation loss picks the rate. MuonClip is
   tuned at `steps` steps, AdamW at every budget it is run at (1, 1.25, 1.5, 2, 3, 4 x `steps`), so a longer AdamW
   run gets its own rate.
2. For each evaluated seed: MuonClip trains `steps` steps and reaches validation loss L. AdamW is then trained with
   growing budgets (each a complete WSD run at that budget's rate, so neither optimizer is judged mid-schedule)
   until one ends at or below L; the tokens AdamW needs are interpolated in log-tokens between the last budget
   above L and the first at or below it.
3. Prints the ratio AdamW tokens / MuonClip tokens per seed and its mean (the Moonlight paper reports ~2x at scale;
   our target is >= 1.3x here) and saves the validation curves to bench/out/muon_vs_adamw.png.

    python bench/muon_vs_adamw.py [--steps 150] [--seeds 3] [--tune-seed 1000]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import torch
from common import tiny_text_corpus

from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.training.presets import get_preset
from kimi_vl.training.trainer import TrainConfig, Trainer, read_metrics

OUT = Path(__file__).parent / "out"
LRS = {"muonclip": (3e-3, 1e-2, 3e-2), "adamw": (3e-3, 1e-2, 3e-2)}
BUDGETS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def run(optimizer: str, lr: float, steps: int, seed: int, data, val, vocab: dict) -> list[dict]:
    torch.manual_seed(seed)
    preset = get_preset("tiny")
    model = KimiTextForCausalLM(KimiTextConfig(**vocab, **preset.text))
    cfg = TrainConfig(steps=steps, lr=lr, optimizer=optimizer, warmup_steps=max(1, steps // 20),
                      val_every=max(1, steps // 10), val_batches=4, checkpoint_every=10**9, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        Trainer(model, data, cfg, tmp, val_data=val).train()
        return read_metrics(Path(tmp) / "metrics.jsonl")


def final_val(metrics: list[dict]) -> float:
    return metrics[-1]["val_loss"]


def sweep(opt: str, grid: list[float], steps: int, seed: int, data, val, vocab: dict) -> float:
    """The learning rate with the best final validation loss, the grid extended by 3x past an edge until the best
    rate is inside it."""
    losses: dict[float, float] = {}
    while grid:
        for lr in grid:
            losses[lr] = final_val(run(opt, lr, steps, seed, data, val, vocab))
            print(f"sweep {opt} {steps} steps lr={lr:g}: val {losses[lr]:.4f}", flush=True)
        tried = sorted(losses)
        top = min(losses, key=losses.get)
        grid = [top * 3] if top == tried[-1] else [top / 3] if top == tried[0] else []
    return min(losses, key=losses.get)


def tokens_to_reach(target: float, opt: str, lrs: dict[float, float], steps: int, seed: int, data, val,
                    vocab: dict, curves: list) -> float | None:
    """AdamW tokens (interpolated in log space between budgets) to end a run at `target` validation loss; budget `b`
    runs at learning rate `lrs[b]`."""
    prev = None
    for b in BUDGETS:
        m = run(opt, lrs[b], round(steps * b), seed, data, val, vocab)
        curves.append((f"{opt} x{b}", m))
        tokens, loss = m[-1]["tokens"], final_val(m)
        print(f"  {opt} budget x{b}: val {loss:.4f} (target {target:.4f})", flush=True)
        if loss <= target:
            if prev is None:  # no budget above `target` to interpolate from: fewer tokens may do
                print(f"  {opt} reached it at its smallest budget x{b}: the ratio is at most x{b}", flush=True)
                return tokens
            t0, l0 = prev
            frac = (l0 - target) / (l0 - loss)
            return math.exp(math.log(t0) + frac * (math.log(tokens) - math.log(t0)))
        prev = (tokens, loss)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3, help="evaluated seeds: 0..N-1")
    ap.add_argument("--tune-seed", type=int, default=1000, help="the seed learning rates are tuned on")
    args = ap.parse_args()
    if args.tune_seed < args.seeds:
        ap.error(f"--tune-seed {args.tune_seed} is one of the evaluated seeds 0..{args.seeds - 1}")
    vocab, data, val = tiny_text_corpus()

    muon_lr = sweep("muonclip", list(LRS["muonclip"]), args.steps, args.tune_seed, data, val, vocab)
    adamw_lrs: dict[float, float] = {}
    for b in BUDGETS:  # each budget's own rate, the sweep centred on the previous budget's best
        prev = adamw_lrs.get(BUDGETS[BUDGETS.index(b) - 1]) if b != BUDGETS[0] else None
        grid = list(LRS["adamw"]) if prev is None else [prev / 3, prev, prev * 3]
        adamw_lrs[b] = sweep("adamw", grid, round(args.steps * b), args.tune_seed, data, val, vocab)
    print(f"chosen on seed {args.tune_seed}: muonclip lr={muon_lr:g}; adamw lr per budget: "
          + ", ".join(f"x{b} {lr:g}" for b, lr in adamw_lrs.items()), flush=True)

    ratios, curves = [], []
    for seed in range(args.seeds):
        muon = run("muonclip", muon_lr, args.steps, seed, data, val, vocab)
        curves.append((f"muonclip seed {seed}", muon))
        target, muon_tokens = final_val(muon), muon[-1]["tokens"]
        print(f"seed {seed}: muonclip val {target:.4f} after {muon_tokens} tokens", flush=True)
        need = tokens_to_reach(target, "adamw", adamw_lrs, args.steps, seed, data, val, vocab, curves)
        if need is None:
            print(f"seed {seed}: AdamW did not reach it within x{BUDGETS[-1]} the tokens")
            ratios.append(BUDGETS[-1])
        else:
            ratios.append(need / muon_tokens)
            print(f"seed {seed}: AdamW needs {need:.0f} tokens -> ratio {ratios[-1]:.2f}x", flush=True)
    spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    print(f"AdamW tokens / MuonClip tokens to reach MuonClip's final validation loss: "
          f"{statistics.mean(ratios):.2f}x (per seed {', '.join(f'{r:.2f}' for r in ratios)}; std {spread:.2f})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, m in curves:
        pts = [(r["tokens"], r["val_loss"]) for r in m if "val_loss" in r]
        ax.plot(*zip(*pts), lw=1.5 if label.startswith("muon") else 0.8,
                color="C0" if label.startswith("muon") else "C1", alpha=0.9, label=label)
    ax.set(xlabel="training tokens", ylabel="validation loss (nats/token)", xscale="log",
           title=f"MuonClip vs AdamW, tiny LM: AdamW needs {statistics.mean(ratios):.2f}x tokens")
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(OUT / "muon_vs_adamw.png", dpi=100)
    print(f"wrote {OUT / 'muon_vs_adamw.png'}")


if __name__ == "__main__":
    main()
