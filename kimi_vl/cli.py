"""The `kimi-vl` command."""

from __future__ import annotations

import argparse
import sys

from .errors import KimiVLError


def _convert(args: argparse.Namespace) -> None:
    from .convert import convert_kimi_linear

    overrides = {"residual": args.residual} if args.residual else {}
    out = convert_kimi_linear(args.src, args.dst, **overrides)
    print(f"wrote {out}")


def _convert_vision(args: argparse.Namespace) -> None:
    from .convert import convert_kimi_k25_vision

    print(f"wrote {convert_kimi_k25_vision(args.src, args.dst)}")


def _export(args: argparse.Namespace) -> None:
    from .export import export_remote_code

    print(f"wrote {export_remote_code(args.model_dir, args.out_dir)}")


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
    export = sub.add_parser("export", help="a saved Kimi-VL model directory -> a self-contained Hugging Face "
                            "remote-code copy (loads with trust_remote_code=True, without kimi_vl installed)")
    export.add_argument("model_dir", help="saved model (+ processor and tokenizer) directory")
    export.add_argument("out_dir", help="destination directory (may be model_dir itself)")
    export.set_defaults(func=_export)
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
