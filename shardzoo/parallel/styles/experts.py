"""The 'experts' style: a module with transformers' experts contract (layers/experts.py) split
over the mesh's ep axis, its tokens dispatched with the dropless all-to-all; transformers'
``ep_dispatch_experts``. The router (transformers' ``ep_router``: 'replicate' here) and any
shared expert are planned as any other module; routing runs the model's own code."""

from __future__ import annotations

from torch import nn

from shardzoo.layers.experts import ExpertsEP, is_experts
from shardzoo.parallel.styles.base import Build, Style


class Experts(Style):
    """E experts -> this rank's E / ep of them (ep = 1: the module stays whole)."""

    name = "experts"
    needs = "a module with the experts contract: gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn, " \
            "forward(hidden, top_k_index, top_k_weights)"

    def accepts(self, module: nn.Module) -> bool:
        return is_experts(module)

    def check_mesh(self, name: str, module: nn.Module, mesh, mode: str) -> None:
        """Raise unless ``module`` (planned as ``name``) splits over ``mesh``'s ep in ``mode``."""
        if mesh.ep_size == 1:
            return
        if mode != "1d":
            raise ValueError(f"ep={mesh.ep_size} with tp_mode={mode!r} is not built: the {mode} layout splits "
                             f"the tokens an expert reads over its grid; expert parallelism works with tp_mode='1d' "
                             f"and tp=1 (with dp, sp and ZeRO); use those, or ep=1")
        if mesh.tp_size > 1:
            raise ValueError(f"ep={mesh.ep_size} with tp={mesh.tp_size} is not built yet: expert parallelism works "
                             f"with tp=1 (with dp, sp and ZeRO); use tp=1, or ep=1")
        n_experts = module.gate_up_proj.shape[0]
        if n_experts % mesh.ep_size != 0:
            raise ValueError(f"{name}: ep={mesh.ep_size} does not divide the {n_experts} experts: each ep rank holds "
                             f"whole experts, n_experts / ep of them; use an ep that divides {n_experts}")

    def build(self, module: nn.Module, ctx: Build) -> nn.Module | None:
        if ctx.mesh.ep_size == 1:
            return None
        self.check_mesh(ctx.name, module, ctx.mesh, ctx.mode)
        return ExpertsEP.from_serial(module, ctx.mesh, device=module.gate_up_proj.device)
