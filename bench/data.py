"""The data layer at scale: index building on a 1,000,000-row JSONL of LLaVA chats with image paths (and its Parquet
copy), then encode+pack throughput against the training step's throughput, in one run.

1. Writes `ROWS` chats (`{"id", "image", "conversations"}`, 100 distinct 112 x 112 PNGs) as JSONL and Parquet under
   `--dir` (kept between runs), and a text-only copy of the first 100,000 rows.
2. Builds each file's index in a fresh process with an empty index cache: rows/s and the peak resident memory it
   adds (peak RSS minus the resident set after imports).
3. encode+pack tokens/s of the `tiny` preset's packed batches (8 x 256 tokens, 64-patch images) from the JSONL, with
   images and text-only, with 0, 1 and 2 data-loader workers (steady state, from the first batch on; interleaved
   rounds, median and spread), against the
   tokens/s of a `tiny` training step (forward, backward, MuonClip) and of a `small`-shape step (hidden 768, 16
   layers; measured on one 512-token row on CPU, where the `small` preset is not meant to run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_mib, run_isolated  # noqa: E402

WORDS = ("the cat sat on a red mat while two dogs ran past the old blue house near the river bank at noon and "
         "everyone watched quietly from the bridge").split()


def write_data(root: Path, rows: int) -> dict[str, Path]:
    """The benchmark's files (written once; reused when present with the same row count)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": root / f"chats_{rows}.jsonl", "parquet": root / f"chats_{rows}.parquet",
             "text": root / f"chats_text_{min(rows, 100_000)}.jsonl"}  # named by row count: reused only when current
    if all(p.is_file() for p in paths.values()):
        return paths
    (root / "img").mkdir(exist_ok=True)
    rng = np.random.RandomState(0)
    for i in range(100):
        Image.fromarray((rng.rand(112, 112, 3) * 255).astype(np.uint8)).save(root / "img" / f"{i}.png")

    def chat(i: int, image: bool) -> dict:
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(8 + i % 24))
        a = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(12 + i % 60))
        row = {"id": str(i), "conversations": [{"from": "human", "value": ("<image>\n" if image else "") + q + "?"},
                                                 {"from": "gpt", "value": a + "."}]}
        if image:
            row["image"] = f"img/{i % 100}.png"
        return row

    t0 = time.perf_counter()
    with open(paths["jsonl"], "w") as f, open(paths["text"], "w") as g:
        for i in range(rows):
            f.write(json.dumps(chat(i, True)) + "\n")
            if i < 100_000:
                g.write(json.dumps(chat(i, False)) + "\n")
    writer = None
    for start in range(0, rows, 100_000):
        table = pa.Table.from_pylist([chat(i, True) for i in range(start, min(rows, start + 100_000))])
        writer = writer or pq.ParquetWriter(paths["parquet"], table.schema)
        writer.write_table(table)
    writer.close()
    print(f"wrote {rows:,} rows as JSONL ({paths['jsonl'].stat().st_size / 2**20:.0f} MiB) and Parquet "
          f"({paths['parquet'].stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s")
    return paths


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _index(path: str, cache: str, queue) -> None:
    """In a fresh process: build `path`'s index with an empty cache; report time, rows and added peak memory."""
    os.environ["KIMI_VL_CACHE"] = cache
    from kimi_vl.data.sources import open_file

    before = _rss_mib()
    t0 = time.perf_counter()
    reader = open_file(Path(path))
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib()
    queue.put({"rows": len(reader), "seconds": seconds, "added_mib": peak - before})


def index_figures(paths: dict[str, Path], cache_root: Path) -> None:
    import shutil

    print("\n## Index build (fresh process, empty cache)\n")
    print("| file | rows | seconds | rows/s | peak RSS added |")
    print("|---|---|---|---|---|")
    for kind in ("jsonl", "parquet"):
        cache = cache_root / f"cache-{kind}"
        shutil.rmtree(cache, ignore_errors=True)
        r = run_isolated(_index, str(paths[kind]), str(cache))
        print(f"| {paths[kind].name} | {r['rows']:,} | {r['seconds']:.2f} | {r['rows'] / r['seconds']:,.0f} | "
              f"{r['added_mib']:.0f} MiB |")


def throughput(paths: dict[str, Path], cache_root: Path, rounds: int, batches: int) -> None:
    import torch

    os.environ["KIMI_VL_CACHE"] = str(cache_root / "cache-jsonl")
    from kimi_vl.data.loader import batches as load
    from kimi_vl.data.mixture import mixture_stream
    from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
    from kimi_vl.training.presets import get_preset
    from kimi_vl.training.stages import build_model, build_processor
    from kimi_vl.training.trainer import TrainConfig, build_optimizer

    torch.set_num_threads(2)
    preset = get_preset("tiny")
    data = preset.data["pretrain"]
    processor = build_processor(data)
    streams = {}
    for name, path in (("chats with images", paths["jsonl"]), ("text-only chats", paths["text"])):
        m = data.mixture([str(path)], 0, ("document", "chat"))
        streams[name] = mixture_stream(m, processor, seq_len=data.seq_len, rows=data.rows, seed=0)
    tokens_per_batch = data.seq_len * data.rows

    model = build_model(preset, processor)
    opt = build_optimizer(model, TrainConfig(steps=10, lr=1e-3))
    train_batch = streams["chats with images"].batch(0)

    def tiny_step() -> float:
        t0 = time.perf_counter()
        loss = model(**train_batch.model_inputs()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return tokens_per_batch / (time.perf_counter() - t0)

    small_text = {**get_preset("small").text}
    small = KimiTextForCausalLM(KimiTextConfig(vocab_size=32768, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               **small_text))
    small_opt = build_optimizer(small, TrainConfig(steps=10, lr=1e-3))
    ids = torch.randint(3, 32768, (1, 512))

    def small_step() -> float:
        t0 = time.perf_counter()
        loss = small(ids, labels=ids).loss
        loss.backward()
        small_opt.step()
        small_opt.zero_grad()
        return ids.numel() / (time.perf_counter() - t0)

    def pack(stream, workers: int, offset: int) -> float:
        """Steady state: timed from the first batch's arrival (workers' start-up excluded)."""
        t0 = None
        for _ in load(stream, list(range(offset, offset + batches + 1)), workers):
            t0 = t0 or time.perf_counter()
        return batches * tokens_per_batch / (time.perf_counter() - t0)

    tiny_step(), small_step()  # warm-up
    results: dict[str, list[float]] = {}
    for r in range(rounds):  # interleaved: every quantity once per round
        results.setdefault("tiny training step", []).append(statistics.median(tiny_step() for _ in range(3)))
        results.setdefault("small-shape training step (1 x 512)", []).append(small_step())
        for name, stream in streams.items():
            for workers in (0, 1, 2):
                key = f"encode+pack, {name}, {workers} worker(s)"
                results.setdefault(key, []).append(pack(stream, workers, 1000 + r * 1000 + workers * 100))
    print(f"\n## Throughput (tokens/s; median and range of {rounds} interleaved rounds; {batches} batches of "
          f"{tokens_per_batch} tokens per encode+pack measurement)\n")
    train = statistics.median(results["tiny training step"])
    print("| what | tokens/s | range | vs the tiny training step |")
    print("|---|---|---|---|")
    for key, values in results.items():
        med = statistics.median(values)
        print(f"| {key} | {med:,.0f} | {min(values):,.0f}-{max(values):,.0f} | {med / train:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dir", default="runs/bench_data", help="where the generated data and caches go")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=12, help="batches per encode+pack measurement")
    args = parser.parse_args()
    root = Path(args.dir)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    paths = write_data(root, args.rows)
    index_figures(paths, root)
    throughput(paths, root, args.rounds, args.batches)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
