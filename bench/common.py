"""Helpers shared by the benchmark scripts: timing medians and reporting ratios against an anchor."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from queue import Empty

# The tiny text config of the benchmarks (hidden 256, 8 layers in the 3:1 hybrid, 8 experts top-2).
TINY_TEXT = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=704, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=4, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
    kda_head_dim=64, kda_num_heads=4, num_experts=8, num_experts_per_tok=2,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def kimi_linear_pair(text: dict, root: str):
    """`(theirs, ours)`: transformers' `KimiLinearForCausalLM` with the sizes of `text` (our `KimiTextConfig` fields,
    e.g. `TINY_TEXT`; 3:1 KDA/MLA, every 4th layer full attention) and random weights, and the same weights converted
    to `KimiTextForCausalLM` (standard residual, as converted checkpoints are), both in eval mode; `root` holds the
    two checkpoints."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from kimi_vl.convert import convert_kimi_linear
    from kimi_vl.text import KimiTextForCausalLM

    layers = text["num_hidden_layers"]
    config = KimiLinearConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        moe_intermediate_size=text["moe_intermediate_size"], num_hidden_layers=layers,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_attention_heads"],
        kv_lora_rank=text["kv_lora_rank"], qk_rope_head_dim=text["qk_rope_head_dim"],
        qk_nope_head_dim=text["qk_nope_head_dim"], v_head_dim=text["v_head_dim"], linear_head_dim=text["kda_head_dim"],
        linear_num_heads=text["kda_num_heads"], num_local_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"], n_shared_experts=text.get("num_shared_experts", 1),
        first_k_dense_replace=text.get("first_k_dense", 1), pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    theirs = KimiLinearForCausalLM(config).eval()
    theirs.save_pretrained(f"{root}/hf")
    convert_kimi_linear(f"{root}/hf", f"{root}/ours")
    return theirs, KimiTextForCausalLM.from_pretrained(f"{root}/ours").eval()


def spread(values: list[float], unit: str = "", digits: int = 2) -> str:
    """`median<unit> [min, max]` of repeated measurements, for the interleaved benchmarks."""
    return f"{statistics.median(values):.{digits}f}{unit} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_isolated(target: Callable, *args) -> dict:
    """Run `target(*args, queue)` in a fresh `spawn` subprocess and return the dict it puts on the queue, so
    each measurement sees only its own allocations (peak resident memory via `peak_rss_mib`); a worker that dies
    before putting raises `RuntimeError`."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    while True:  # a worker that dies (an exception, the out-of-memory killer) never puts: stop instead of waiting
        try:
            out = queue.get(timeout=1.0)
            break
        except Empty:
            if not proc.is_alive():
                raise RuntimeError(f"benchmark worker {target.__name__} exited with status {proc.exitcode} "
                                   "before reporting (its traceback is above)") from None
    proc.join()
    return out


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB: `VmHWM` of `/proc/self/status` (Linux; KiB there). Not
    `ru_maxrss`: the kernel carries the parent's peak into a spawned process's `ru_maxrss`, so a `run_isolated`
    worker smaller than its parent would read the parent's peak as its own and undercount its growth."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def tiny_text_corpus() -> tuple[dict, object, object]:
    """`(token-id kwargs for KimiTextConfig, train stream, validation stream)`: the `tiny` preset's tokenizer and
    text-only packed streams of the embedded corpus (validation from a disjoint seed)."""
    from kimi_vl.data import embedded_pretrain_stream
    from kimi_vl.training.presets import get_preset
    from kimi_vl.training.stages import build_processor

    preset = get_preset("tiny")
    data = preset.data["pretrain"]
    proc = build_processor(data)
    tok = proc.tokenizer
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    stream = dict(seq_len=data.seq_len, rows=data.rows, vision_ratio=0.0)
    return ids, embedded_pretrain_stream(proc, seed=0, **stream), embedded_pretrain_stream(proc, seed=10**6, **stream)
