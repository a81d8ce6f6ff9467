"""`kimi-vl data check`: read every record of some data sources as training would, and report.

Each record is read, its format detected (or `fmt`), parsed (roles, placeholders against media, an assistant turn,
an RL answer the reward can score), its media decoded, and, with a processor, encoded exactly as training encodes
it. The report counts per source the records, images, videos and tokens (exact with a processor; without one, text
bytes / 4 plus the vision tokens the default image and video processors give), and lists every bad record as
`FILE:ROW: reason`, and a source without any record as `SOURCE: has no records` (training refuses it).

Row length: training skips a chat longer than a packed row (`seq_len`, a chat is placed whole). The check flags a
chat whose token count (exact with a processor, else the estimate) exceeds `seq_len`; without one it uses
`DEFAULT_SEQ_LEN`, the longest row of the presets, so that only chats no preset can train on are flagged (a run
with a shorter `--seq-len` may still skip longer chats than that: pass its `seq_len` to check them). An image or a
video chunk longer than a row (with its framing tokens) is flagged too, in any document or chat: training skips it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadRecordError, ConfigError, DataError
from ..progress import progress_bar
from ..vision import MoonViTImageProcessor, MoonViTVideoProcessor
from ..vision.media import load_video
from .encode import encode_chat, encode_document, encode_prompt
from .formats import Record, error_reason, get_format, parse_record
from .mixture import chat_too_long, check_media_blocks, media_block_too_long
from .sources import Source, open_source

DEFAULT_SEQ_LEN = 4096
"""Row length chats are checked against when none is given: the longest `seq_len` of the presets (`small`'s)."""


@dataclass
class SourceReport:
    """What `check_source` found in one source."""

    name: str
    records: int = 0
    images: int = 0
    videos: int = 0
    tokens: int = 0
    exact_tokens: bool = False
    formats: Counter = field(default_factory=Counter)
    bad: list[tuple[str, Any, str]] = field(default_factory=list)  # (file, row, reason); row None: the whole source


def _estimate_tokens(record: Record, loaded: Any, image_processor: Any, video_processor: Any
                     ) -> tuple[int, list[tuple[str, int]]]:
    """Text bytes / 4 plus the vision tokens of the record's media under the default processors; and each media
    block's `(kind, vision tokens)` (an image, or one chunk of a video)."""
    tokens, blocks = len(record.text().encode("utf-8")) // 4, []
    media = ([s.value for s in loaded if hasattr(s, "kind")] if record.kind == "document" else
             [p[p["type"]] for m in (loaded if record.kind == "chat" else loaded.messages) for p in m["content"]
              if p["type"] in ("image", "video")])
    for value in media:
        if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
            w, h = value.size
            blocks.append(("image", image_processor.get_num_image_tokens(h, w)))
            tokens += blocks[-1][1]
        else:
            frames = (load_video(value, fps=video_processor.fps).frames if isinstance(value, str)
                      else np.asarray(value))
            tokens += video_processor.get_num_video_tokens(frames.shape[0], frames.shape[1], frames.shape[2])
            blocks.append(("video chunk", video_processor.get_num_video_tokens(1, frames.shape[1], frames.shape[2])))
    return tokens, blocks


def _encoded_tokens(record: Record, loaded: Any, processor: Any, seq_len: int) -> int:
    """The record's tokens as training encodes it; a media block longer than a row is a bad record, as in training."""
    if record.kind == "document":
        return len(check_media_blocks(encode_document(loaded, processor), seq_len, processor))
    if record.kind == "chat":
        return len(check_media_blocks(encode_chat(loaded, processor), seq_len, processor))
    return len(encode_prompt(loaded, processor)[0])


def check_source(source: Source, *, fmt: str = "auto", reward: str | None = None, processor: Any = None,
                 progress: bool = True, seq_len: int | None = None) -> SourceReport:
    """Read every record of `source` (see the module docstring); `seq_len`: the packed row length chats must fit
    (default `DEFAULT_SEQ_LEN`)."""
    if source.streaming:
        raise ConfigError(f"{source.name}: a streamed dataset has no end to check; check a downloaded copy.")
    seq_len = DEFAULT_SEQ_LEN if seq_len is None else int(seq_len)
    forced = None if fmt == "auto" else get_format(fmt)
    image_processor = MoonViTImageProcessor() if processor is None else processor.image_processor
    video_processor = MoonViTVideoProcessor() if processor is None else processor.video_processor
    report = SourceReport(source.name, exact_tokens=processor is not None)
    for i in progress_bar(range(len(source)), desc=f"check {source.name}", enabled=progress, unit="record"):
        try:
            row, reader, base = source.read(i)
            record = parse_record(row, forced or (get_format(reader.format_hint) if reader.format_hint else None),
                                  base, reward=reward)
            loaded = record.loaded()
            if processor is not None:
                tokens = _encoded_tokens(record, loaded, processor, seq_len)
            else:
                tokens, blocks = _estimate_tokens(record, loaded, image_processor, video_processor)
                for kind, n in blocks if record.kind != "prompt" else []:  # as `check_media_blocks` in training
                    if why := media_block_too_long(n, seq_len, kind):
                        raise BadRecordError(why)
            if record.kind == "chat" and (why := chat_too_long(tokens, seq_len, estimated=processor is None)):
                raise BadRecordError(why)
        except (ConfigError, DataError) as exc:
            if not isinstance(exc, BadRecordError):
                raise
            report.bad.append((*source.where(i), exc.reason))
            continue
        except Exception as exc:  # what training would skip as a bad record
            report.bad.append((*source.where(i), error_reason(exc)))
            continue
        report.records += 1
        refs = record.media()
        report.images += sum(r.kind == "image" for r in refs)
        report.videos += sum(r.kind == "video" for r in refs)
        report.tokens += tokens
        report.formats[f"{record.format} ({record.kind})"] += 1
    if len(source) == 0:
        report.bad.append((source.name, None, f"has no records (training refuses an empty source); {_EMPTY_FIX}"))
    return report


_EMPTY_FIX = "check the path, or that the file is not empty (blank lines and empty Parquet files hold no record)"


def check(specs: list[str], *, fmt: str = "auto", media_root: str | None = None, reward: str | None = None,
          processor: Any = None, progress: bool = True, seq_len: int | None = None) -> list[SourceReport]:
    """`check_source` of each `--data` entry."""
    if not specs:
        raise ConfigError("name at least one data source to check.")
    return [check_source(open_source(s, media_root=media_root), fmt=fmt, reward=reward, processor=processor,
                         progress=progress, seq_len=seq_len) for s in specs]


def format_report(reports: list[SourceReport]) -> str:
    """One `FILE:ROW: reason` line per bad record (`SOURCE: reason` for a problem of a whole source, such as having
    no records), then a table of the per-source counts."""
    lines = [f"{file}: {reason}" if row is None else f"{file}:{row}: {reason}"
             for r in reports for file, row, reason in r.bad]
    if lines:
        lines.append("")
    lines.append("| source | formats | good records | bad records | images | videos | tokens |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in reports:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.formats.items())) or "-"
        tokens = f"{r.tokens:,}" if r.exact_tokens else f"~{r.tokens:,}"
        bad = sum(row is not None for _, row, _ in r.bad)
        lines.append(f"| {r.name} | {kinds} | {r.records:,} | {bad:,} | {r.images:,} | {r.videos:,} | {tokens} |")
    total_bad = sum(row is not None for r in reports for _, row, _ in r.bad)
    empty = [r.name for r in reports if any(row is None for _, row, _ in r.bad)]
    lines.append("")
    summary = [f"{total_bad} bad record(s)."] if total_bad else []
    if empty:
        summary.append(f"{len(empty)} source(s) without any record: {', '.join(empty)}.")
    lines.append(" ".join(summary) if summary else "All records are good.")
    return "\n".join(lines)


__all__ = ["DEFAULT_SEQ_LEN", "SourceReport", "check", "check_source", "format_report"]
