"""Train a small GPT-2 for a few AdamW steps on synthetic tokens, on any layout.

    python examples/train_gpt.py --tp 4 --tp-mode 2d --pp 2 --steps 5         # 8 local ranks
    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 2 --sp 2 --dp 2

Shows step i/N, the loss, the global gradient norm and tokens/s per step on rank 0 (one line
updated in place on a terminal). `--schedule interleaved --virtual 2` runs two stages per rank. The data is a fixed
random sequence repeated with a shift, so the loss falls quickly when training works.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _train_loop import layout_args, make_mesh, train, world_of  # noqa: E402


def batches_for(args, vocab: int):
    base = torch.randint(0, vocab, (args.seq * 4,), generator=torch.Generator().manual_seed(args.seed))

    def batch(step):
        starts = (torch.arange(args.batch) * 7 + step) % (base.numel() - args.seq - 1)
        rows = torch.stack([base[s: s + args.seq + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    return batch


def main(args):
    from shardzoo.models import GPT2, GPT2Config

    torch.manual_seed(args.seed)
    mesh = make_mesh(args)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=max(args.seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def build(stage, device):  # on meta, then only this rank's shards on device, seeded
        return GPT2(config, mesh=mesh, stage=stage, sp_mode=args.sp_mode, checkpointing=args.checkpointing,
                    device=device, seed=args.seed)

    return train(args, mesh, build, batches_for(args, args.vocab), args.batch * args.seq, "tokens")


if __name__ == "__main__":
    parser = layout_args(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    from shardzoo import launch

    launch(main, world_of(args), args)
