"""Quality at equal tokens: the 3:1 KDA/MLA hybrid against all-MLA of the same sizes.

Both tiny LMs (the `tiny` preset's text config; layer_types the only difference) train on the same batches of the
embedded text corpus with MuonClip and the same schedule, `--seeds` seeds each; prints the final validation losses
and their difference (hybrid - all-MLA, negative = hybrid better). Decode speed and cache memory of the two are
measured by bench/decode.py.

    python bench/hybrid_vs_mla.py [--steps 300] [--seeds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import tiny_text_corpus

from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
from kimi_vl.training.presets import get_preset
from kimi_vl.training.trainer import TrainConfig, Trainer, read_metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    preset = get_preset("tiny")
    ids, data, val = tiny_text_corpus()
    n = preset.text["num_hidden_layers"]
    layouts = {"hybrid 3:1": None, "all-MLA": ["mla"] * n}
    losses: dict[str, list[float]] = {name: [] for name in layouts}
    for seed in range(args.seeds):
        for name, layer_types in layouts.items():
            torch.manual_seed(seed)
            model = KimiTextForCausalLM(KimiTextConfig(**ids, layer_types=layer_types, **preset.text))
            cfg = TrainConfig(steps=args.steps, lr=preset.stages["pretrain"].lr, warmup_steps=20, val_batches=8,
                              checkpoint_every=10**9, progress=False)
            with tempfile.TemporaryDirectory() as tmp:
                Trainer(model, data, cfg, tmp, val_data=val).train()
                losses[name].append(read_metrics(Path(tmp) / "metrics.jsonl")[-1]["val_loss"])
            print(f"seed {seed} {name}: validation loss {losses[name][-1]:.4f}", flush=True)
    deltas = [a - b for a, b in zip(losses["hybrid 3:1"], losses["all-MLA"])]
    tokens = args.steps * preset.data["pretrain"].rows * preset.data["pretrain"].seq_len
    print(f"after {tokens} tokens: hybrid {statistics.fmean(losses['hybrid 3:1']):.4f}, all-MLA "
          f"{statistics.fmean(losses['all-MLA']):.4f}; hybrid - all-MLA = {statistics.fmean(deltas):+.4f} "
          f"(per seed {', '.join(f'{d:+.4f}' for d in deltas)})")


if __name__ == "__main__":
    main()
