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
    from shardzoo.demo import run_demo

    run_demo(ranks=args.ranks, hidden=args.hidden, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardzoo",
        description="Parallel transformer building blocks for PyTorch (tensor 1D/2D/2.5D/3D, "
        "ring attention, pipeline-ready models, sharded checkpoints).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="print versions and what this machine can run")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="run parallel layers on local CPU ranks and check them against serial")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks: 1, 2, 4 or 8 (default 4)")
    demo.add_argument("--hidden", type=int, default=64, help="hidden size of the MLP block (default 64)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    from shardzoo.checkpoint.cli import add_convert_parser

    add_convert_parser(sub)
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
