"""The `kimi-vl` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import KimiVLError


def _convert(args: argparse.Namespace) -> None:
    from .convert import convert_kimi_linear

    overrides = {"residual": args.residual} if args.residual else {}
    out = convert_kimi_linear(args.src, args.dst, **overrides)
    print(f"wrote {out}")


def _convert_released(args: argparse.Namespace) -> None:
    from .convert import convert_deepseek_v3, convert_kimi_k25

    convert = convert_kimi_k25 if args.kind == "kimi-k25" else convert_deepseek_v3
    overrides = {"residual": args.residual} if args.residual else {}
    print(f"wrote {convert(args.src, args.dst, overwrite=args.overwrite, **overrides)}")


def _convert_vision(args: argparse.Namespace) -> None:
    from .convert import convert_kimi_k25_vision

    print(f"wrote {convert_kimi_k25_vision(args.src, args.dst)}")


def _export(args: argparse.Namespace) -> None:
    from .export import export_remote_code

    print(f"wrote {export_remote_code(args.model_dir, args.out_dir)}")


def _pretrain(args: argparse.Namespace) -> None:
    from .training.stages import pretrain

    print(f"wrote {pretrain(args.out, preset=args.preset, steps=args.steps, seed=args.seed)}")


def _sft(args: argparse.Namespace) -> None:
    from .training.stages import sft

    print(f"wrote {sft(args.from_dir, args.out, steps=args.steps, seed=args.seed)}")


def _rl(args: argparse.Namespace) -> None:
    from .training.stages import rl

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    out = rl(args.from_dir, args.out, tasks=tasks, steps=args.steps, seed=args.seed, algorithm=args.algorithm)
    print(f"wrote {out}")


def _ablate(args: argparse.Namespace) -> None:
    from .eval.ablation import vision_rl_ablation

    vision_rl_ablation(args.from_dir, args.out, seeds=args.seeds, steps=args.steps, data_dir=args.data_dir,
                       limit=args.limit)
    print((Path(args.out) / "ablation.md").read_text())


def _add_train_parsers(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="training stages (each writes a Hugging Face checkpoint directory and "
                           "resumes from its last checkpoint when rerun)")
    stages = train.add_subparsers(dest="stage", required=True)
    pre = stages.add_parser("pretrain", help="joint text-vision pre-training from scratch on the embedded corpus")
    pre.add_argument("--preset", default="tiny", help="model/data/schedule preset: tiny (CPU) or small (one GPU)")
    sft = stages.add_parser("sft", help="zero-vision SFT (text-only chats) from a checkpoint")
    sft.add_argument("--from", dest="from_dir", required=True, help="checkpoint directory to start from")
    rl = stages.add_parser("rl", help="joint text-vision RL (K2.5 objective, verifiable rewards) from a checkpoint")
    rl.add_argument("--from", dest="from_dir", required=True, help="checkpoint directory to start from (SFT)")
    rl.add_argument("--tasks", default="text,vision", help="task families: text, vision or text,vision")
    rl.add_argument("--algorithm", choices=["k25", "grpo"], default="k25")
    for stage, func in ((pre, _pretrain), (sft, _sft), (rl, _rl)):
        stage.add_argument("--out", required=True, help="output checkpoint directory")
        stage.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
        stage.add_argument("--seed", type=int, default=0)
        stage.set_defaults(func=func)


def _quickstart(args: argparse.Namespace) -> None:
    from .quickstart import quickstart

    report = quickstart(args.out, preset=args.preset, data_dir=args.data_dir, scale=args.scale,
                        eval_limit=args.eval_limit, seed=args.seed)
    print(f"wrote {report}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-vl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="import released Hugging Face checkpoints")
    kinds = convert.add_subparsers(dest="kind", required=True)
    kl = kinds.add_parser("kimi-linear", help="a transformers kimi_linear checkpoint -> kimi_vl_text")
    kl.add_argument("src", help="source checkpoint directory (config.json + *.safetensors)")
    kl.add_argument("dst", help="destination directory")
    kl.add_argument("--residual", choices=["standard", "attnres", "block_attnres"], default=None,
                    help="residual stream of the converted model (default: standard, exact parity)")
    kl.set_defaults(func=_convert)
    kv = kinds.add_parser("kimi-k25-vision", help="the MoonViT-3D tower + projector of a transformers kimi_k25 "
                          "checkpoint -> MoonViTModel (+ projector.safetensors)")
    kv.add_argument("src", help="source checkpoint directory (config.json + *.safetensors)")
    kv.add_argument("dst", help="destination directory")
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
    qs.add_argument("--preset", default="tiny", help="tiny (2 CPU cores, about 9 min) or small (one GPU)")
    qs.add_argument("--data-dir", default=None, help="local MMLU-Pro / MathVista files (default: synthetic proxies)")
    qs.add_argument("--scale", type=float, default=1.0, help="multiply every stage's step count (e.g. 0.05: smoke)")
    qs.add_argument("--eval-limit", type=int, default=None, help="at most N items per benchmark")
    qs.add_argument("--seed", type=int, default=0)
    qs.set_defaults(func=_quickstart)
    export = sub.add_parser("export", help="a saved Kimi-VL model directory -> a self-contained Hugging Face "
                            "remote-code copy (loads with trust_remote_code=True, without kimi_vl installed)")
    export.add_argument("model_dir", help="saved model (+ processor and tokenizer) directory")
    export.add_argument("out_dir", help="destination directory (may be model_dir itself)")
    export.set_defaults(func=_export)
    _add_train_parsers(sub)
    from .eval.runner import add_eval_arguments, run_eval_from_args

    ev = sub.add_parser("eval", help="MMLU-Pro / MathVista (official protocols) and their offline proxies")
    add_eval_arguments(ev)
    ev.set_defaults(func=run_eval_from_args)
    ablate = sub.add_parser("ablate", help="ablations")
    kinds = ablate.add_subparsers(dest="ablation", required=True)
    vrl = kinds.add_parser("vision-rl", help="RL text-only vs text+vision from one SFT checkpoint, evaluated on text "
                           "and vision benchmarks, seeds and 95%% CIs")
    vrl.add_argument("--from", dest="from_dir", required=True, help="SFT checkpoint directory")
    vrl.add_argument("--out", required=True)
    vrl.add_argument("--seeds", type=int, default=3)
    vrl.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the preset's)")
    vrl.add_argument("--data-dir", default=None, help="local MMLU-Pro / MathVista files (default: synthetic proxies)")
    vrl.add_argument("--limit", type=int, default=None, help="at most N items per benchmark")
    vrl.set_defaults(func=_ablate)
    from .demos.video2web import add_video2web_parser

    demo = sub.add_parser("demo", help="demos: video2web (a screencast -> a web page, rendered and scored)")
    add_video2web_parser(demo.add_subparsers(dest="demo", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KimiVLError as e:
        print(f"kimi-vl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
