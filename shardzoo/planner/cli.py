"""``shardzoo plan``: the layout planner on the command line (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank every legal dp x pp x sp x tp layout of a model by predicted step time",
                       description="Enumerate every legal layout (dp x pp x sp x tp, tp_mode, micro-batches, "
                       "activation checkpointing, ZeRO stage) of MODEL, predict memory, communication and step time, "
                       "and print the fastest that fit. Exit code 1 when none fits.")
    from shardzoo.planner.presets import HF_MODELS, model_names

    p.add_argument("model", metavar="MODEL", help=f"a preset ({', '.join(model_names())}; those of transformers "
                   f"models, {', '.join(sorted(HF_MODELS))}, with transformers installed) or a Hugging Face model "
                   "directory (shardzoo's families, or a causal LM transformers builds, such as llama, qwen2, "
                   "mistral: priced with pp=1 as shardzoo.parallelize splits it)")
    p.add_argument("--world", type=int, required=True, metavar="N", help="number of devices (ranks)")
    p.add_argument("--device-memory-gib", type=float, metavar="M", help="memory per device, GiB (required, except "
                   "with --price: default the hardware's)")
    p.add_argument("--global-batch", type=int, required=True, metavar="B", help="sequences per training step")
    p.add_argument("--seq", type=int, required=True, metavar="S", help="tokens per sequence (a model making its own sequence, such as an image model: any "
                   "value; its tokens come from its input)")
    p.add_argument("--hardware", default="h100", metavar="PRESET|calibrate",
                   help="a100, h100, h200, or cpu / calibrate: this host, measured once and cached (default h100)")
    nodes = p.add_mutually_exclusive_group()
    nodes.add_argument("--nodes", type=int, metavar="K", help="the world is K nodes of world/K devices")
    nodes.add_argument("--devices-per-node", type=int, metavar="D", help="devices per node (default: the preset's)")
    p.add_argument("--top", type=int, default=None, metavar="K", help="candidates shown (default 10; --json: all)")
    p.add_argument("--json", action="store_true", help='print {"hardware": {...}, "candidates": [...], "pick": {...}} (pick: the first candidate\'s '
                   'memory terms and the lines that run it; null when none fits)')
    p.add_argument("--explain", metavar="LAYOUT", help="why a layout is legal or not and what it costs, e.g. "
                   "dp=2,pp=1,sp=1,tp=4,tp_mode=2d")
    p.add_argument("--sp-mode", default="ring", choices=["ring", "ulysses"], help="attention over sp (default ring)")
    p.add_argument("--schedule", default=None, choices=["1f1b", "gpipe", "interleaved", "interleaved_1f1b",
                                                       "zero_bubble", "zbv", "dualpipev"],
                   help="pipeline schedule of pp > 1 candidates (default: every schedule on accelerator presets, "
                   "those of several chunks per rank at 2 chunks; 1f1b on cpu / calibrate); with --price: the one "
                   "priced (default 1f1b), with --virtual-stages")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="bf16 autocast (default on accelerators) or fp32 "
                   "(default on cpu / calibrate)")
    p.add_argument("--recalibrate", action="store_true", help="with --hardware calibrate: measure again")
    price = p.add_argument_group("pricing one layout (--price)")
    price.add_argument("--price", metavar="LAYOUT", help="price this layout alone, e.g. dp=12,pp=12,tp=8 (missing sizes "
                       "1, dp the rest): step time, tokens/s and model TFLOP/s per device")
    price.add_argument("--micro-batches", type=int, metavar="M", help="with --price: micro-batches (default the most)")
    price.add_argument("--checkpointing", action="store_true", help="with --price: activation checkpointing on")
    price.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="with --price: ZeRO stage (default 0)")
    price.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                       help="with --price and a schedule of several chunks per rank: model chunks per pipeline rank "
                       "(zbv, dualpipev: 2)")
    price.add_argument("--attention", default="flash", choices=["flash", "materialized"],
                       help="the attention kernel priced (default flash, what shardzoo runs)")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from shardzoo.planner.api import plan
    from shardzoo.planner.report import explain_text, nothing_fits, run_text, table, why

    if args.price:
        return run_price(args)
    if args.device_memory_gib is None:
        print("shardzoo plan: error: --device-memory-gib is required", file=sys.stderr)
        return 2
    if args.top is not None and args.top < 1:
        print(f"shardzoo plan: error: --top {args.top} must be at least 1", file=sys.stderr)
        return 2
    try:
        result = plan(args.model, args.world, args.device_memory_gib, args.global_batch, args.seq,
                      hardware=args.hardware, nodes=args.nodes, devices_per_node=args.devices_per_node,
                      top=args.top if args.json or args.explain else None, sp_mode=args.sp_mode,
                      schedule=args.schedule, dtype=args.dtype, recalibrate=args.recalibrate)
    except ValueError as err:  # bad input: the message names the value, the rule and the fix
        print(f"shardzoo plan: error: {err}", file=sys.stderr)
        return 2
    if args.explain:
        try:
            print(explain_text(result, args.explain))
        except ValueError as err:
            print(f"shardzoo plan: error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        top = args.top or 10
        print(f"{result.problem.shape.name or args.model} on {args.world} x {result.hardware.name} "
              f"({args.device_memory_gib:g} GiB each), global batch {args.global_batch} x {args.seq} tokens: "
              f"{result.count} candidates, {sum(c.fits for c in result)} fit")
        print(table(result[:top]))
        if result.fits:
            print(why(result, result[0]))
            print(run_text(result, result[0]))
    if not result.fits:
        print(f"shardzoo plan: {nothing_fits(result)}" if result else "shardzoo plan: no legal layout (see --explain)",
              file=sys.stderr)
        return 1
    return 0


def run_price(args: argparse.Namespace) -> int:
    """``--price LAYOUT``: one candidate priced (``api.price``); exit 1 when it does not fit."""
    from shardzoo.planner.api import price

    try:
        priced = price(args.model, args.world, args.global_batch, args.seq, args.price,
                       micro_batches=args.micro_batches, checkpointing=args.checkpointing, zero=args.zero,
                       hardware=args.hardware, nodes=args.nodes, devices_per_node=args.devices_per_node,
                       device_memory_gib=args.device_memory_gib, sp_mode=args.sp_mode, schedule=args.schedule or "1f1b",
                       virtual_stages=args.virtual_stages, dtype=args.dtype, attention=args.attention)
    except ValueError as err:
        print(f"shardzoo plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(priced.to_json(), indent=1) if args.json else priced.describe())
    return 0 if priced.candidate.fits else 1
