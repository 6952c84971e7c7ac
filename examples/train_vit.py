"""Train a small ViT classifier for a few AdamW steps on synthetic images, on any layout.

    python examples/train_vit.py --tp 4 --tp-mode 2d --steps 5
    python examples/train_vit.py --tp 2 --sp 2 --pp 2

Each class is a fixed random image plus noise, so the loss falls quickly when training works.
Shows step i/N, the loss, the global gradient norm and images/s per step on rank 0.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _train_loop import layout_args, make_mesh, train, world_of  # noqa: E402


def batches_for(args):
    gen = torch.Generator().manual_seed(args.seed)
    prototypes = torch.randn(args.classes, 3, args.image, args.image, generator=gen)

    def batch(step):
        g = torch.Generator().manual_seed(args.seed + 1 + step)
        labels = torch.randint(0, args.classes, (args.batch,), generator=g)
        return prototypes[labels] + 0.5 * torch.randn(args.batch, 3, args.image, args.image, generator=g), labels

    return batch


def main(args):
    from shardzoo.models import ViT, ViTConfig

    torch.manual_seed(args.seed)
    mesh = make_mesh(args)
    config = ViTConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       intermediate_size=4 * args.hidden, image_size=args.image, patch_size=args.patch,
                       num_labels=args.classes)

    def build(stage, device):  # on meta, then only this rank's shards on device, seeded
        return ViT(config, mesh=mesh, stage=stage, sp_mode=args.sp_mode, checkpointing=args.checkpointing,
                   device=device, seed=args.seed)

    return train(args, mesh, build, batches_for(args), args.batch, "images")


if __name__ == "__main__":
    parser = layout_args(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--image", type=int, default=16)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--classes", type=int, default=10)
    args = parser.parse_args()
    from shardzoo import launch

    launch(main, world_of(args), args)
