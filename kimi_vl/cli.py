"""The `kimi-vl` command."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from . import __version__
from .errors import ConfigError, KimiVLError, TrainingInterrupted
from .options import positive_int
from .progress import transformers_bars


def _convert(args: argparse.Namespace) -> None:
    from .convert import convert_kimi_linear

    overrides = {"residual": args.residual} if args.residual else {}
    out = convert_kimi_linear(args.src, args.dst, overwrite=args.overwrite, **overrides)
    print(f"wrote {out}")


def _convert_released(args: argparse.Namespace) -> None:
    from .convert import convert_deepseek_v3, convert_kimi_k25

    convert = convert_kimi_k25 if args.kind == "kimi-k25" else convert_deepseek_v3
    overrides = {"residual": args.residual} if args.residual else {}
    print(f"wrote {convert(args.src, args.dst, overwrite=args.overwrite, **overrides)}")


def _convert_vision(args: argparse.Namespace) -> None:
    from .convert import convert_kimi_k25_vision

    print(f"wrote {convert_kimi_k25_vision(args.src, args.dst, overwrite=args.overwrite)}")


def _export(args: argparse.Namespace) -> None:
    from .export import export_remote_code

    print(f"wrote {export_remote_code(args.model_dir, args.out_dir, overwrite=args.overwrite)}")


def _train(args: argparse.Namespace) -> None:
    from .training import is_main_process, stages
    from .training.config import load_config_file, stage_overrides

    settings = load_config_file(args.config) if args.config else {}
    preset = args.preset or settings.pop("preset", None)
    seed = args.seed if args.seed is not None else int(settings.pop("seed", 0))
    settings.pop("preset", None)
    settings.pop("seed", None)
    settings.update(stage_overrides(args, args.stage))
    if args.stage in ("vit", "pretrain"):
        run = stages.vit if args.stage == "vit" else stages.pretrain
        out = run(args.out, preset=preset or "tiny", seed=seed, **settings)
    else:
        run = stages.sft if args.stage == "sft" else stages.rl
        out = run(args.from_dir, args.out, preset=preset, seed=seed, **settings)
    if is_main_process():  # rank 0 writes the summary; one line per run, not per rank
        print(f"wrote {out} ({stages.summary_line(stages.read_summary(out) or {})})")


def _eval(args: argparse.Namespace) -> None:
    from .eval.runner import run_eval_from_args

    run_eval_from_args(args)


def _ablate(args: argparse.Namespace) -> None:
    from .eval.ablation import vision_rl_ablation

    vision_rl_ablation(args.from_dir, args.out, seeds=args.seeds, steps=args.steps, data_dir=args.data_dir,
                       limit=args.limit, progress=args.progress)
    print((Path(args.out) / "ablation.md").read_text())


STAGE_HELP = {
    "vit": "ViT training: the vision tower alone on the synthetic world's labelled images (counts, shapes' and "
           "pages' colours, bar charts); writes a MoonViT checkpoint for pretrain's --vision-tower",
    "pretrain": "joint text-vision pre-training: on the embedded data, or on --data (documents and chats; a BPE "
                "tokenizer is trained on them unless --tokenizer); the vision tower from scratch or from "
                "--vision-tower",
    "sft": "SFT from a checkpoint: zero-vision (text-only chats) on the embedded data, or on --data (chats)",
    "rl": "joint text-vision RL (K2.5 objective, verifiable rewards) from a checkpoint: on the synthetic world's "
          "tasks, or on --data (verl / EasyR1 prompt rows)",
}


def _add_train_parsers(sub: argparse._SubParsersAction) -> None:
    from .training.config import add_stage_options

    train = sub.add_parser("train", help="training stages (each writes a Hugging Face checkpoint directory and "
                           "resumes from its last checkpoint when rerun)")
    stages = train.add_subparsers(dest="stage", required=True)
    for stage, help_text in STAGE_HELP.items():
        p = stages.add_parser(stage, help=help_text, description=help_text + ". Every setting below can also come "
                              "from --config FILE (YAML or JSON, the same names); the resolved configuration is "
                              "written to OUT/run_config.json.")
        if stage not in ("vit", "pretrain"):
            p.add_argument("--from", dest="from_dir", required=True, help="checkpoint directory to start from")
        p.add_argument("--out", required=True, help="output checkpoint directory")
        p.add_argument("--preset", default=None, help="model/data/schedule preset: tiny (CPU) or small (one GPU); "
                       "default: tiny (vit, pretrain), the checkpoint's preset (sft, rl)")
        p.add_argument("--config", default=None, help="YAML or JSON file of settings (options override it)")
        p.add_argument("--seed", type=int, default=None,
                       help="seed of the initialisation, data order and sampling (default: --config's, else 0)")
        add_stage_options(p, stage)
        p.set_defaults(func=_train)


def _data_check(args: argparse.Namespace) -> int:
    from .data.check import check, format_report

    processor = None
    if args.tokenizer:
        from .data.config import DataConfig
        from .processing import KimiVLProcessor
        from .training.stages import build_processor

        folder = Path(args.tokenizer)
        processor = (KimiVLProcessor.from_pretrained(folder) if (folder / "processor_config.json").is_file()
                     else build_processor(DataConfig(tokenizer=args.tokenizer)))
    reports = check(args.sources, fmt=args.format, media_root=args.media_root, reward=args.reward,
                    processor=processor, progress=args.progress, seq_len=args.seq_len)
    print(format_report(reports))
    return 1 if any(r.bad for r in reports) else 0


def _add_progress_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show progress (a bar on a terminal, lines in a log)")


def _add_data_parsers(sub: argparse._SubParsersAction) -> None:
    from .data.formats import REWARD_CHOICES

    data = sub.add_parser("data", help="data tools")
    tools = data.add_subparsers(dest="tool", required=True)
    chk = tools.add_parser("check", help="read every record as training would and report per-source counts and "
                           "every bad record (FILE:ROW: reason); exit status 1 when a record is bad")
    chk.add_argument("sources", nargs="+", metavar="SRC",
                     help="a file, a folder, a glob or hf:ORG/NAME[:CONFIG][@SPLIT]")
    chk.add_argument("--format", default="auto", help="record schema of every source (default: detected)")
    chk.add_argument("--media-root", default=None, help="folder relative media paths are read from")
    chk.add_argument("--reward", choices=REWARD_CHOICES, default=None, help="RL reward of every prompt row")
    chk.add_argument("--tokenizer", default=None, help="a checkpoint or tokenizer folder: count tokens exactly "
                     "(default: an estimate)")
    chk.add_argument("--seq-len", type=positive_int, default=None, help="the packed row length of the run the "
                     "data is for: chats longer than it are listed, as training skips them (default: the longest "
                     "preset row, 4096)")
    _add_progress_option(chk)
    chk.set_defaults(func=_data_check)


def _quickstart(args: argparse.Namespace) -> None:
    from .quickstart import headline, quickstart

    report = quickstart(args.out, preset=args.preset, data_dir=args.data_dir, scale=args.scale,
                        eval_limit=args.eval_limit, seed=args.seed, progress=args.progress)
    print("\n".join(headline(report.parent)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-vl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="import released Hugging Face checkpoints")
    kinds = convert.add_subparsers(dest="kind", required=True)
    kl = kinds.add_parser("kimi-linear", help="a transformers kimi_linear checkpoint -> kimi_vl_text")
    kl.add_argument("src", help="source checkpoint directory (config.json + *.safetensors)")
    kl.add_argument("dst", help="destination directory (written atomically; must not exist or be empty)")
    kl.add_argument("--residual", choices=["standard", "attnres", "block_attnres"], default=None,
                    help="residual stream of the converted model (default: standard, exact parity)")
    kl.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    kl.set_defaults(func=_convert)
    kv = kinds.add_parser("kimi-k25-vision", help="the MoonViT-3D tower + projector of a transformers kimi_k25 "
                          "checkpoint -> MoonViTModel (+ projector.safetensors)")
    kv.add_argument("src", help="source checkpoint directory (config.json + *.safetensors)")
    kv.add_argument("dst", help="destination directory (written atomically; must not exist or be empty)")
    kv.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    kv.set_defaults(func=_convert_vision)
    released = {
        "kimi-k25": "a whole transformers kimi_k25 vision-language model (Kimi K2.5 / K2.6: MoonViT-3D + DeepSeek-V3 "
                    "text) -> KimiVLForConditionalGeneration (+ processor and tokenizer when present)",
        "deepseek-v3": "a transformers deepseek_v3 / kimi_k2 text model -> kimi_vl_text (RoPE-MLA layers)",
    }
    for kind, description in released.items():
        kp = kinds.add_parser(kind, help=description)
        kp.add_argument("src", help="source checkpoint directory (config.json + *.safetensors); streamed, never loaded")
        kp.add_argument("dst", help="destination directory (written atomically; must not exist or be empty)")
        kp.add_argument("--residual", choices=["standard", "attnres", "block_attnres"], default=None,
                        help="residual stream of the converted model (default: standard; the AttnRes choices start "
                        "from zero pseudo-queries, i.e. exactly the released model)")
        kp.add_argument("--overwrite", action="store_true", help="replace an existing destination")
        kp.set_defaults(func=_convert_released)
    qs = sub.add_parser("quickstart", help="the whole pipeline offline on the embedded data: tokenizer, pre-training, "
                        "zero-vision SFT, joint RL, evaluation, the video2web demo, a checkpoint and REPORT.md "
                        "(resumable: rerun to continue)")
    qs.add_argument("--out", default="runs/quickstart", help="output directory (default: runs/quickstart)")
    qs.add_argument("--preset", default="tiny",
                    help="tiny (2 CPU cores: 19 min on a fast machine, 27-56 on slower ones) or small (one GPU)")
    qs.add_argument("--data-dir", default=None, help="local MMLU-Pro / MathVista files (default: synthetic proxies)")
    qs.add_argument("--scale", type=float, default=1.0, help="multiply every stage's step count (e.g. 0.05: smoke)")
    qs.add_argument("--eval-limit", type=int, default=None, help="at most N items per benchmark")
    qs.add_argument("--seed", type=int, default=0, help="seed of every stage (default: 0)")
    _add_progress_option(qs)
    qs.set_defaults(func=_quickstart)
    export = sub.add_parser("export", help="a saved Kimi-VL model directory -> a self-contained Hugging Face "
                            "remote-code copy (loads with trust_remote_code=True, without kimi_vl installed)")
    export.add_argument("model_dir", help="saved model (+ processor and tokenizer) directory")
    export.add_argument("out_dir", help="destination directory: new or empty, or model_dir itself (in place)")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty destination directory")
    export.set_defaults(func=_export)
    _add_train_parsers(sub)
    _add_data_parsers(sub)
    from .eval.ablation import ABLATION_PROXY_ITEMS, ABLATION_SEEDS
    from .eval.runner import add_eval_arguments

    ev = sub.add_parser("eval", help="registered benchmarks: MMLU-Pro / MathVista (official protocols) and their "
                        "offline proxies")
    add_eval_arguments(ev)
    ev.set_defaults(func=_eval)
    ablate = sub.add_parser("ablate", help="ablations")
    kinds = ablate.add_subparsers(dest="ablation", required=True)
    vrl = kinds.add_parser("vision-rl", help="RL text-only vs text+vision from one SFT checkpoint, evaluated on text "
                           "and vision benchmarks, seeds and 95%% CIs")
    vrl.add_argument("--from", dest="from_dir", required=True, help="SFT checkpoint directory")
    vrl.add_argument("--out", required=True, help="output directory: an RL run and its evaluation per arm and seed, "
                     "then ablation.md / .json / .png (rerun to resume)")
    vrl.add_argument("--seeds", type=int, default=ABLATION_SEEDS,
                     help=f"paired RL runs per arm (default {ABLATION_SEEDS}: on the tiny quickstart's SFT checkpoint, "
                     "with the proxies' default items, both deltas' 95%% half-widths are 0.6-1.1 points; about 9.5 min "
                     "on 2 fast CPU cores, 16-35 min on slower ones)")
    vrl.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the preset's)")
    vrl.add_argument("--data-dir", default=None, help="local MMLU-Pro / MathVista files (default: synthetic proxies)")
    vrl.add_argument("--limit", type=int, default=None, help="items per benchmark (default: all of a real benchmark; "
                     "of the proxies " + ", ".join(f"{n} {b}" for b, n in ABLATION_PROXY_ITEMS.items())
                     + ", whose first ones are the quickstart's pinned items)")
    _add_progress_option(vrl)
    vrl.set_defaults(func=_ablate)
    from .demos.video2web import add_video2web_parser

    demo = sub.add_parser("demo", help="demos: video2web (a screencast -> a web page, rendered and scored)")
    add_video2web_parser(demo.add_subparsers(dest="demo", required=True))
    return parser


PACKAGE_DIR = Path(__file__).resolve().parent


def _one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
    """`warnings.showwarning` that prints kimi-vl's own warnings as one line, `kimi-vl: warning: ...`, like its errors
    (not with the source line Python shows), on rank 0 only under a launcher (every rank would print the same
    line), and passes other libraries' warnings to `show`."""

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: TextIO | None = None, line: str | None = None) -> None:
        if Path(filename).resolve().is_relative_to(PACKAGE_DIR):
            if os.environ.get("RANK", "0") == "0":  # the launcher's rank: set before any process group exists
                print(f"kimi-vl: warning: {message}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def _one_process_unless_training(args: argparse.Namespace) -> None:
    """Only `kimi-vl train STAGE` shares its work between the ranks of `torchrun` / `accelerate launch`; any other
    command would run once per rank, each writing the same files."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and args.func is not _train:
        raise ConfigError(f"`kimi-vl {args.command}` runs in one process, but was launched as {world} (WORLD_SIZE="
                          f"{world}); run it without torchrun / accelerate launch (only `kimi-vl train STAGE` "
                          "trains across processes)")


def _end_process_group(owned: bool) -> None:
    """Destroy the process group the command started (under torchrun / accelerate launch), as torch asks of a normal
    exit: left to interpreter exit, NCCL warns on every rank and gloo's threads can abort a finished rank. Only on
    the paths where every rank gets here together; after an error the ranks may be out of step."""
    import gc

    import torch.distributed as dist

    if owned and dist.is_initialized():
        gc.collect()  # the finished run's DDP / FSDP2 wrappers (reference cycles) still hold the group
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = build_parser().parse_args(argv)
    owns_group = not dist.is_initialized()  # a launcher's ranks: accelerate starts the group inside the command
    # transformers' own bars (loading and writing weights) follow --no-progress and stay out of logs too
    with transformers_bars(getattr(args, "progress", True)):
        return _run(args, owns_group)


def _run(args: argparse.Namespace, owns_group: bool) -> int:
    """`args.func(args)`, its exceptions turned into a message and an exit status."""
    try:
        _one_process_unless_training(args)
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            status = int(args.func(args) or 0)
        _end_process_group(owns_group)
        return status
    except TrainingInterrupted as e:
        _end_process_group(owns_group)  # every rank stopped after the same step
        print(f"kimi-vl: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print("kimi-vl: interrupted; rerun the same command to go on (training resumes from its last checkpoint, "
              "evaluation from its cached responses)", file=sys.stderr)
        return 130
    except KimiVLError as e:
        print(f"kimi-vl: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .data.loader import worker_error

        error = worker_error(e)
        if error is None:
            raise
        print(f"kimi-vl: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
