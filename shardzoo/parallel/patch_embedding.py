"""The ``patch_embedding`` style: an embedding that makes the token sequence itself from its
input (a ViT's pixels -> cls token + patches + positions), planned whole.

The planned module is a Hugging Face-style ``ViTEmbeddings``: ``patch_embeddings.projection``
(an ``nn.Conv2d`` with kernel_size = stride), ``cls_token`` [1, 1, H], ``position_embeddings``
[1, T, H] and an optional ``dropout`` (``nn.Dropout``). The layout builds it
(``TensorLayout.patch_embedding``: the tensors indexed by H split like an embedding table's,
the pixels split along the batch only), so every rank makes all T tokens of its batch rows.

Under sp a forward hook then pads the T tokens to a multiple of sp, keeps this rank's
contiguous chunk, and records a key mask hiding the padding in the SDPA mode's state
(sdpa_mode.py, ANDed with the forward's own padding mask), so every attention after it ignores
the padded keys. A pipeline stage without the embedding records the same mask with
:func:`mask_padding` (models/planned.py). Padded query rows compute values nobody reads.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.parallel import hf_model, sdpa_mode


def local_tokens(tokens: int, sp: int) -> int:
    """Tokens per sp rank once ``tokens`` are padded to a multiple of ``sp``."""
    return math.ceil(tokens / sp)


def mask_padding(state, tokens: int, rows: int, device=None) -> None:
    """AND the key mask of this sp rank's chunk of ``tokens`` padded tokens (bool [rows, s],
    False on the padding) into ``state.key_padding_mask`` (inputs.Parallelized); nothing when
    ``tokens`` divides over sp."""
    mesh = state.mesh
    local = local_tokens(tokens, mesh.sp_size)
    if local * mesh.sp_size == tokens:
        return
    positions = torch.arange(mesh.sp_rank * local, (mesh.sp_rank + 1) * local, device=device)
    mask = (positions < tokens)[None].expand(rows, -1)  # [rows, s]
    current = state.key_padding_mask
    if current is not None and tuple(current.shape) != (rows, local):
        raise ValueError(f"the padding mask given to the forward has shape {tuple(current.shape)}, but the "
                         f"embedding made {local} tokens per sp rank for {rows} rows; pass no mask (the "
                         f"sequence padding is masked already) or one of [{rows}, {local}]")
    state.key_padding_mask = mask if current is None else current & mask


class ShardTokens:
    """Forward hook of the layout's patch embedding under sp: its tokens [b, T, H_l] -> this sp
    rank's chunk [b, ceil(T / sp), H_l] (zeros padding the last chunks), the padding recorded
    in the SDPA state of the model it belongs to."""

    def __init__(self, root: nn.Module, mesh):
        self.root, self.mesh = weakref.ref(root), mesh  # weak: the model owns this module

    def __call__(self, module: nn.Module, args: tuple, x: torch.Tensor) -> torch.Tensor:
        root = self.root()
        mode = sdpa_mode.sdpa_mode_of(root) if root is not None else None
        if not isinstance(mode, sdpa_mode.SequenceParallelSDPA):
            raise RuntimeError(f"a 'patch_embedding' under sp={self.mesh.sp_size} records its sequence padding in "
                               f"the SDPA route of the model it belongs to, which {type(root).__name__} has none "
                               f"of; parallelize the model holding it (a module of one's own), or use sp=1")
        tokens, sp = x.shape[1], self.mesh.sp_size
        local = local_tokens(tokens, sp)
        mask_padding(mode.state, tokens, x.shape[0], x.device)
        if local * sp != tokens:
            x = F.pad(x, (0, 0, 0, local * sp - tokens))  # [b, local * sp, H_l]
        # a plain slice: each sp rank's gradient covers its own tokens, as for token ids
        return x.narrow(1, self.mesh.sp_rank * local, local)


def check_patch_embedding(name: str, module: nn.Module, pattern: str) -> None:
    """Refuse a module planned 'patch_embedding' that is not a ViTEmbeddings-like module."""
    proj = getattr(getattr(module, "patch_embeddings", None), "projection", None)
    cls_token, positions = getattr(module, "cls_token", None), getattr(module, "position_embeddings", None)
    if not (isinstance(proj, nn.Conv2d) and isinstance(cls_token, torch.Tensor) and cls_token.dim() == 3
            and isinstance(positions, torch.Tensor) and positions.dim() == 3):
        raise ValueError(f"plan entry {pattern!r} makes {name} ({type(module).__name__}) a 'patch_embedding', which "
                         f"needs a ViTEmbeddings-like module: patch_embeddings.projection (nn.Conv2d), cls_token "
                         f"[1, 1, H] and position_embeddings [1, T, H]; change the style or the pattern")
    dropout = getattr(module, "dropout", None)
    if dropout is not None and not isinstance(dropout, nn.Dropout):
        raise ValueError(f"{name}.dropout is a {type(dropout).__name__}; a 'patch_embedding' draws its dropout "
                         f"through the layout, which needs an nn.Dropout there")


def build_patch_embedding(module: nn.Module, mesh, model: nn.Module, zigzag: bool, make) -> nn.Module:
    """The patch embedding ``make(module)`` builds: pixels [b, C, img, img] -> tokens
    [b, T, H_l], under sp this rank's chunk [b, ceil(T / sp), H_l] (module doc)."""
    if mesh.sp_size > 1 and (zigzag or hf_model.is_transformers_model(model)):
        why = ("the model is causal, whose sp shards are zigzag; parallelize with causal=False" if zigzag else
               "a transformers model's attention does not read the SDPA route; plan it for sp=1 only")
        raise ValueError(f"a 'patch_embedding' under sp={mesh.sp_size} cuts its tokens into contiguous chunks, but "
                         f"{why}")
    layer = make(module)
    layer.train(module.training)
    if mesh.sp_size > 1:
        layer.register_forward_hook(ShardTokens(model, mesh))
    return layer
