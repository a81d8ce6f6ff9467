"""Small users' data sets in every supported schema, written into a folder by the tests (images with Pillow, a
video with PyAV), with known bad records.

`write_user_data(root)` returns `{name: path}` for: `docs.jsonl` (text documents, placeholders and prepended
images), `obelics.parquet`, `shards/` (two WebDataset tar shards), `notes/` (plain .txt), `llava.json` (a JSON
array), `messages.jsonl` (typed parts and a video), `sharegpt.jsonl`, `verl.parquet` (image bytes) and
`easyr1.jsonl`; `BAD` lists each file's bad rows as `FILE:ROW` strings `kimi-vl data check` must print.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from kimi_vl.data.screencast import write_video

BAD = {
    "docs.jsonl": {"docs.jsonl:8", "docs.jsonl:9", "docs.jsonl:11"},  # malformed JSON, count mismatch, missing file
    "llava.json": {"llava.json:5", "llava.json:6", "llava.json:7"},  # corrupt image, no assistant turn, missing image
    "messages.jsonl": {"messages.jsonl:4"},  # unknown role
    "verl.parquet": {"verl.parquet:5"},  # no RL answer
    "easyr1.jsonl": {"easyr1.jsonl:3"},  # missing image
}


def image(seed: int, w: int = 56, h: int = 42) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


def write_user_data(root: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    (root / "img").mkdir(exist_ok=True)
    for i in range(6):
        image(i, 56 + 14 * (i % 3), 42).save(root / "img" / f"{i}.png")
    (root / "img" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    frames = [np.full((48, 64, 3), 20 * t, dtype=np.uint8) for t in range(8)]
    write_video(frames, root / "clip.mp4", fps=4)
    paths: dict[str, Path] = {}

    paths["docs.jsonl"] = _jsonl(root / "docs.jsonl", [
        {"text": "The first document is plain text about foxes and dogs."},
        {"text": "A caption <image> in the middle, then more words.", "images": ["img/0.png"]},
        {"text": "Two pictures: <image> and <image>.", "images": ["img/1.png", "img/2.png"]},
        "",
        {"text": "No placeholder: the image goes first.", "images": ["img/3.png"]},
        {"text": "A video <video> of a screen.", "videos": ["clip.mp4"]},
        {"text": "Plain text again, <|im_end|> stays text here."},
        "{not json",
        {"text": "one placeholder <image> <image>", "images": ["img/0.png"]},
        {"text": "Frames as a video: <video>", "videos": [["img/0.png", "img/0.png", "img/0.png"]]},
        {"text": "missing <image>", "images": ["img/nowhere.png"]},
    ])
    pq.write_table(pa.Table.from_pylist([
        {"texts": ["Intro paragraph.", None, "After the image.", "More."], "images": [None, "img/4.png", None, None]},
        {"texts": [None, "Caption below."], "images": ["img/5.png", None]},
    ]), root / "obelics.parquet")
    paths["obelics.parquet"] = root / "obelics.parquet"

    (root / "shards").mkdir(exist_ok=True)
    for s in range(2):
        with tarfile.open(root / "shards" / f"part-{s:05d}.tar", "w") as tar:
            for k in range(3):
                key = f"sample{s}{k}"
                members = {f"{key}.png": png_bytes(image(10 * s + k)),
                           f"{key}.txt" if k != 1 else f"{key}.json":
                           (f"caption {s}{k}" if k != 1 else json.dumps({"caption": f"json caption {s}{k}"})).encode()}
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    paths["shards"] = root / "shards"

    (root / "notes").mkdir(exist_ok=True)
    (root / "notes" / "a.txt").write_text("A plain text file with <image> in it, which stays text.")
    (root / "notes" / "b.txt").write_text("Another note.\n" * 5)
    paths["notes"] = root / "notes"

    llava = [{"id": str(i), "image": f"img/{i}.png", "conversations": [
        {"from": "human", "value": "<image>\nDescribe the picture."},
        {"from": "gpt", "value": f"A random picture, number {i}."}]} for i in range(5)]
    llava += [
        {"id": "corrupt", "image": "img/corrupt.png", "conversations": [
            {"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "Nothing."}]},
        {"id": "no-reply", "conversations": [{"from": "human", "value": "Hello?"}]},
        {"id": "missing", "image": "img/missing.png", "conversations": [
            {"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "Nothing."}]},
        {"id": "text-only", "conversations": [{"from": "human", "value": "What is 2 + 2?"},
                                              {"from": "gpt", "value": "4"}]},
    ]
    (root / "llava.json").write_text(json.dumps(llava, indent=1))
    paths["llava.json"] = root / "llava.json"

    paths["messages.jsonl"] = _jsonl(root / "messages.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Mostly grey."}]}],
         "images": ["img/1.png"]},
        {"messages": [{"role": "user", "content": "<video>What happens?"},
                      {"role": "assistant", "content": "The screen gets brighter."}], "videos": ["clip.mp4"]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]},
        {"messages": [{"role": "narrator", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    ])
    paths["sharegpt.jsonl"] = _jsonl(root / "sharegpt.jsonl", [
        {"system": "You answer in one word.", "conversations": [{"from": "human", "value": "Sky colour?"},
                                                               {"from": "gpt", "value": "Blue."}]},
    ])

    pq.write_table(pa.Table.from_pylist([
        {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": f"<image>What is {i} + 1?"}],
         "images": [{"bytes": png_bytes(image(i)), "path": None}],
         "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
        for i in range(5)] + [
        {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": "<image>No answer here."}],
         "images": [{"bytes": png_bytes(image(9)), "path": None}],
         "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": 5}},
    ]), root / "verl.parquet")
    paths["verl.parquet"] = root / "verl.parquet"
    paths["easyr1.jsonl"] = _jsonl(root / "easyr1.jsonl", [
        {"problem": "<image>Which option, A or B?", "answer": "B", "images": ["img/2.png"]},
        {"problem": "Say the colour of the sky.", "answer": "blue"},
        {"problem": "<image>Count.", "answer": "3", "images": ["img/gone.png"]},
    ])
    return paths
