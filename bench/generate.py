"""Greedy `generate` throughput of `KimiTextForCausalLM` against transformers' `KimiLinearForCausalLM`, and the eval
harness's MMLU-Pro proxy throughput.

1. `generate` (default): the `tiny` shape (bench/common.py `TINY_TEXT`: hidden 256, 8 layers) and the `small`
   preset's text shape (hidden 768, 16 layers, 16 experts top-2, vocabulary 32768), each as transformers'
   `KimiLinearForCausalLM` with random weights and the same weights converted to ours (standard residual, as
   converted checkpoints are); prompts of `--context` random tokens (default 1K), batch 1 and 8, `--new` greedy
   tokens (fp32, CPU). The two models' `generate` calls alternate, `--rounds` times; a streamer time-stamps every
   step, giving per call: prefill seconds (prompt to first token), decode tokens/s (new tokens after the first, over
   their time) and end-to-end new tokens/s (all new tokens over the whole call). Prints medians with [min, max] and
   the ratios ours/transformers per round (median, spread), and whether both produced the same tokens.
   transformers runs its pure-PyTorch CPU fallbacks here (no flash-linear-attention / causal-conv1d on CPU).
2. `--eval`: items/s of `kimi_vl.eval.evaluate` on the `mmlu_pro_synth` proxy with the options the quickstart
   uses (`PROXY_EVAL_CONFIG`: zero-shot chat prompts, 96 new tokens; greedy, batches of 8) for a random model of
   the `tiny` preset's shape (the quickstart model: hidden 128, 4 layers, Block AttnRes) with a BPE tokenizer
   trained on the proxy's own text; `--eval-rounds` timed runs after a warm-up. Run it under two source trees to
   compare code versions: `PYTHONPATH=/path/to/old python bench/generate.py --eval`.
3. `--compile`: whether `torch.compile` pays on CPU: the tiny-shape decode step (batch 1, `--context` tokens of
   random cache) eager against `torch.compile(model.forward, dynamic=True)`: compile seconds (the first compiled
   calls) and per-step milliseconds of each, interleaved over `--rounds` rounds of 20 steps.

    python bench/generate.py [--shapes tiny,small] [--batches 1,8] [--context 1024] [--new 32] [--rounds 3]
    python bench/generate.py --eval [--eval-items 32] [--eval-rounds 3]
    python bench/generate.py --compile [--context 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch
from common import TINY_TEXT, kimi_linear_pair, spread
from transformers.generation.streamers import BaseStreamer

SMALL_VOCAB = 32768  # the small preset's tokenizer size (its DataConfig.vocab_size)


class StepClock(BaseStreamer):
    """Time stamps of `generate`'s streamer calls: the prompt, then one per new token (batch-wide)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model, ids: torch.Tensor, new: int) -> tuple[dict[str, float], torch.Tensor]:
    """One greedy `generate` of exactly `new` tokens: prefill seconds, decode and end-to-end new tokens/s."""
    clock = StepClock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None, streamer=clock)
    total = time.perf_counter() - t0
    first, last = clock.stamps[1], clock.stamps[-1]
    batch = ids.shape[0]
    stats = {"prefill s": first - t0, "decode tok/s": batch * (new - 1) / (last - first),
             "e2e tok/s": batch * new / total}
    return stats, out[:, ids.shape[1]:]



def bench_generate(args) -> None:
    from kimi_vl.training.presets import get_preset

    shapes = {"tiny": TINY_TEXT, "small": {**get_preset("small").text, "vocab_size": SMALL_VOCAB}}
    rows = []
    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            theirs, ours = kimi_linear_pair(shapes[shape], tmp)
        models = {"ours": ours, "transformers": theirs}
        for batch in (int(b) for b in args.batches.split(",")):
            ids = torch.randint(3, shapes[shape]["vocab_size"], (batch, args.context))
            load_before = os.getloadavg()[0]
            for m in models.values():  # warm-up (allocator, MKL buffers)
                timed_generate(m, ids[:, : args.context // 4], 2)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
            same = []
            for _ in range(args.rounds):
                tokens = {}
                for name, m in models.items():
                    stats, tokens[name] = timed_generate(m, ids, args.new)
                    runs[name].append(stats)
                same.append(torch.equal(tokens["ours"], tokens["transformers"]))
            rows.append((shape, batch, runs, same, load_before, os.getloadavg()[0]))
            print_row(*rows[-1])
        del models, ours, theirs
    print(f"\n{args.context} prompt tokens, {args.new} new tokens, fp32, {args.threads} threads, {args.rounds} rounds "
          "(generate calls alternating ours / transformers); median [min, max]")
    print("| shape | batch | ours prefill s | theirs prefill s | ours decode tok/s | theirs decode tok/s "
          "| decode ratio | ours e2e tok/s | theirs e2e tok/s | e2e ratio | same tokens | load before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = [round_ratios(runs) for _, _, runs, *_ in rows]
    for (shape, batch, runs, same, before, after), ratio in zip(rows, ratios):
        col = {k: {name: [r[k] for r in runs[name]] for name in runs} for k in runs["ours"][0]}
        print(f"| {shape} | {batch} | {spread(col['prefill s']['ours'])} | {spread(col['prefill s']['transformers'])} "
              f"| {spread(col['decode tok/s']['ours'])} | {spread(col['decode tok/s']['transformers'])} "
              f"| {spread(ratio['decode tok/s'])}x | {spread(col['e2e tok/s']['ours'])} "
              f"| {spread(col['e2e tok/s']['transformers'])} | {spread(ratio['e2e tok/s'])}x | {sum(same)}/{len(same)} "
              f"| {before:.2f} -> {after:.2f} |")
    for (shape, batch, *_), ratio in zip(rows, ratios):
        for k, r in ratio.items():
            print(f"RATIO generate {k} ours/transformers, {shape} batch {batch} = {spread(r, 'x')} (target >= 2x)")


def round_ratios(runs: dict[str, list[dict[str, float]]]) -> dict[str, list[float]]:
    """Per-round ours/transformers ratios of decode and end-to-end tokens/s."""
    return {k: [a[k] / b[k] for a, b in zip(runs["ours"], runs["transformers"])] for k in ("decode tok/s", "e2e tok/s")}


def print_row(shape, batch, runs, same, before, after) -> None:
    for name, stats in runs.items():
        print(f"{shape:5s} batch {batch} {name:12s} " + ", ".join(
            f"{k} {spread([s[k] for s in stats])}" for k in stats[0]) + f"; load {before:.2f} -> {after:.2f}",
            flush=True)
    print(f"{shape:5s} batch {batch} same tokens in {sum(same)}/{len(same)} rounds", flush=True)


def bench_eval(args) -> None:
    from kimi_vl.eval.generation import Engine
    from kimi_vl.eval.proxies import PROXY_EVAL_CONFIG, mmlu_pro_synth
    from kimi_vl.eval.runner import evaluate
    from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
    from kimi_vl.tokenization import build_tokenizer
    from kimi_vl.training.presets import get_preset

    test, val = mmlu_pro_synth(args.eval_items)
    tok = build_tokenizer([" ".join([r["question"], *r["options"]]) for r in test + val] * 4, 1536)
    torch.manual_seed(0)
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    model = KimiTextForCausalLM(KimiTextConfig(**get_preset("tiny").text, **ids)).eval()
    engine = Engine(model=model, tokenizer=tok, name="tiny-preset-random")
    config = dataclasses.replace(PROXY_EVAL_CONFIG, limit=args.eval_items, batch_size=8, progress=False)
    rates = []
    for i in range(args.eval_rounds + 1):  # the first run is a warm-up
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            evaluate(engine, "mmlu_pro_synth", out, config)
            if i:
                rates.append(args.eval_items / (time.perf_counter() - t0))
    print(f"EVAL mmlu_pro_synth: {args.eval_items} items, batch 8, zero-shot chat, {config.max_new_tokens} new tokens, "
          f"tiny preset shape (random weights), {args.threads} threads: {spread(rates)} items/s "
          f"(median [min, max] of {args.eval_rounds} runs); "
          f"load {os.getloadavg()[0]:.2f}")


def bench_compile(args) -> None:
    from kimi_vl.text import KimiHybridCache, KimiTextConfig, KimiTextForCausalLM

    torch.manual_seed(0)
    model = KimiTextForCausalLM(KimiTextConfig(**TINY_TEXT)).eval()
    cache = KimiHybridCache.random(model.config, args.context, max_length=args.context + 64 * (args.rounds + 2))
    token = torch.tensor([[3]])
    compiled = torch.compile(model.forward, dynamic=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(3):  # compiles (and recompiles while the cache length changes)
            compiled(token, cache=cache)
        compile_s = time.perf_counter() - t0
        steps: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name, fn in (("eager", model.forward), ("compiled", compiled)):
                t0 = time.perf_counter()
                for _ in range(20):
                    fn(token, cache=cache)
                steps[name].append((time.perf_counter() - t0) / 20 * 1e3)
    print(f"COMPILE tiny decode step, batch 1, {args.context} cached tokens, {args.threads} threads: first 3 compiled "
          f"calls {compile_s:.1f} s; ms/step eager {spread(steps['eager'])}, compiled {spread(steps['compiled'])}; "
          f"load {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,small")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval", action="store_true", help="measure the MMLU-Pro proxy throughput instead")
    ap.add_argument("--compile", action="store_true", help="measure torch.compile of the decode step instead")
    ap.add_argument("--eval-items", type=int, default=32)
    ap.add_argument("--eval-rounds", type=int, default=3)
    args = ap.parse_args()
    if args.new < 2:
        ap.error("--new must be at least 2: decode tokens/s counts the new tokens after the first")
    torch.set_num_threads(args.threads)
    if args.eval:
        bench_eval(args)
    elif args.compile:
        bench_compile(args)
    else:
        bench_generate(args)


if __name__ == "__main__":
    main()
