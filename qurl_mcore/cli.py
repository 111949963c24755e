"""The `qurl` command line."""
from __future__ import annotations

import argparse


def _quant_report(args: argparse.Namespace) -> int:
    from .quant_report import run

    print(run(args.tensor, args.rows, args.json))
    return 0


def _prepare_models(args: argparse.Namespace) -> int:
    from .models.smollm2 import hf_checkpoint
    from .models.tiny import ARCHS, tiny_checkpoint

    print(f"smollm2: {hf_checkpoint()}")
    for arch in ARCHS:
        print(f"tiny {arch}: {tiny_checkpoint(arch)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qurl", description="Quantized-rollout RL for Megatron-Core and SGLang.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("quant-report", help="each format's error and the RC gain on a real weight matrix")
    rep.add_argument("--tensor", default="token_embd.weight", help="GGUF tensor name of SmolLM2-135M-Instruct")
    rep.add_argument("--rows", type=int, default=4096, help="first rows of the tensor to use (default 4096)")
    rep.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rep.set_defaults(func=_quant_report)
    prep = sub.add_parser("prepare-models", help="convert/generate the cached test and demo checkpoints")
    prep.set_defaults(func=_prepare_models)
    args = parser.parse_args(argv)
    return args.func(args)
