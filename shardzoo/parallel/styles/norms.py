"""The 'norm' style: a LayerNorm or RMSNorm over the hidden size (torch's, or a model's own class
of that name computing the plain formula), in the layout's split: [b, s, H_l] -> same. The
'column_norm' style: such a norm over the whole width of a column layer's output (OLMoE's
q_norm / k_norm over every head), split like that output (1d: over tp, [b, s, W/p] -> same).

A model's own norm class is replaced by the plain torch norm of its weights, after checking on
a random input that the two compute the same (``_check_plain``), so a norm of another formula
(Gemma's ``x * (1 + w)``) is refused by name rather than replaced by a wrong one.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardzoo.layers.norm_1d import ColumnLayerNorm1D, ColumnRMSNorm1D, LayerNorm1D, RMSNorm1D
from shardzoo.layers.norm_2d import LayerNorm2D, RMSNorm2D
from shardzoo.layers.norm_2p5d import LayerNorm2p5D, RMSNorm2p5D
from shardzoo.layers.norm_3d import LayerNorm3D, RMSNorm3D
from shardzoo.parallel.kinds import is_norm
from shardzoo.parallel.styles.base import Build, Layer, Style, canonical


class Norm(Style):
    """The layout's LayerNorm / RMSNorm from the planned norm (module doc)."""

    name = "norm"
    on_sequence_chunks = True
    needs = "a LayerNorm or RMSNorm"
    layers = {"1d": Layer(LayerNorm1D), "2d": Layer(LayerNorm2D, canonical), "2.5d": Layer(LayerNorm2p5D, canonical),
              "3d": Layer(LayerNorm3D, canonical)}
    rms_layers = {"1d": Layer(RMSNorm1D), "2d": Layer(RMSNorm2D, canonical),
                  "2.5d": Layer(RMSNorm2p5D, canonical), "3d": Layer(RMSNorm3D, canonical)}

    def accepts(self, module: nn.Module) -> bool:
        return is_norm(module)

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        plain = _plain_norm(ctx.name, module)
        _check_plain(ctx.name, module)
        cls, options = (self.layers if isinstance(plain, nn.LayerNorm) else self.rms_layers)[ctx.mode]
        device = plain.weight.device if plain.weight is not None else None
        return cls.from_serial(plain, ctx.mesh, device=device, **options(ctx))


def _column_output(ctx: Build) -> dict:
    """A norm reading a column layer's output takes that output's placement (3D swaps two axes)."""
    return {"placement": ctx.layout.linear_output(ctx.layout.activation)}


class ColumnNorm(Norm):
    """A norm over a column layer's whole output width, split like that output (module doc): in
    1d over tp, its statistics all-reduced over tp; in the grid layouts the grid norm in the
    column output's placement."""

    name = "column_norm"
    on_sequence_chunks = True  # it reads a column layer's output, whose every token it holds: exact in a block
    layers = {"1d": Layer(ColumnLayerNorm1D), "2d": Layer(LayerNorm2D, _column_output),
              "2.5d": Layer(LayerNorm2p5D, _column_output), "3d": Layer(LayerNorm3D, _column_output)}
    rms_layers = {"1d": Layer(ColumnRMSNorm1D), "2d": Layer(RMSNorm2D, _column_output),
                  "2.5d": Layer(RMSNorm2p5D, _column_output), "3d": Layer(RMSNorm3D, _column_output)}

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        owner = ctx.attention.get(ctx.name.rpartition(".")[0])
        width = getattr(module, "weight", None)
        if owner is not None and owner.replicated_kv and width is not None \
                and width.shape[0] == owner.kv_heads * owner.head_dim:
            raise ValueError(f"{ctx.name}: a 'column_norm' over the {owner.kv_heads} kv heads of {owner.name}, which "
                             f"the layout repeats over its {owner.parts} head parts (kv heads < parts), would see "
                             f"repeated heads; use a tp whose head parts divide the {owner.kv_heads} kv heads")
        return super().build(module, ctx)


def _check_plain(name: str, module: nn.Module) -> None:
    """Raise unless ``module`` equals its plain norm on a random input (with random weights
    when ``module`` is on the meta device: the formula is what is checked).

    The probe runs on a float64 copy of ``module``, whatever the model's dtype: a bf16 norm
    that computes in fp32 and casts back (transformers' LlamaRMSNorm) rounds differently from
    a plain bf16 norm, which is rounding, not another formula. In float64 the two agree to the
    precision the module computes in (at worst fp32 inside), far inside the bound below, while
    a norm of another formula (Gemma's ``x * (1 + w)``) misses it by the size of its weights."""
    if type(module) in (nn.LayerNorm, nn.RMSNorm):  # torch's own, affine or not: plain by definition
        return
    probe_module = copy.deepcopy(module)
    if any(p.is_meta for p in module.parameters()):
        probe_module = probe_module.to_empty(device="cpu")
        with torch.no_grad():
            for p in probe_module.parameters():
                p.normal_()
    probe_module = probe_module.to(torch.float64)
    plain = _plain_norm(name, probe_module)
    weight = plain.weight
    probe = torch.randn(3, plain.normalized_shape[0], dtype=torch.float64, device=weight.device)
    with torch.no_grad():
        ok = torch.allclose(probe_module(probe).double(), plain(probe), rtol=1e-4, atol=1e-5)
    if not ok:
        raise ValueError(f"{name} ({type(module).__name__}) does not compute a plain {type(plain).__name__} "
                         f"(y = norm(x) * weight [+ bias]); shardzoo cannot split it as 'norm'. Plan it as "
                         f"'replicate' in 1d, or write it as nn.{type(plain).__name__}")


def _plain_norm(name: str, module: nn.Module) -> nn.Module:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return module
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{name} ({type(module).__name__}) has no 1-d weight; plan it as 'replicate' or write it "
                         f"as nn.LayerNorm / nn.RMSNorm")
    eps = next((getattr(module, a) for a in ("variance_epsilon", "eps", "epsilon") if hasattr(module, a)), 1e-6)
    bias = getattr(module, "bias", None)
    if "rms" in type(module).__name__.lower():
        plain = nn.RMSNorm(weight.shape[0], eps=eps, dtype=weight.dtype, device=weight.device)
    else:
        plain = nn.LayerNorm(weight.shape[0], eps=eps, bias=bias is not None, dtype=weight.dtype,
                             device=weight.device)
    with torch.no_grad():
        plain.weight.copy_(weight)
        if isinstance(plain, nn.LayerNorm) and bias is not None:
            plain.bias.copy_(bias)
    return plain
