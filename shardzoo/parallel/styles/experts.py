"""The 'experts' style: a module with transformers' experts contract (layers/experts.py) split
over the mesh's ep axis, its tokens dispatched with the dropless all-to-all; transformers'
``ep_dispatch_experts``. The 'router' style (transformers' ``ep_router``): the module that
routes, kept whole on every rank, running the model's own code. Any shared expert is planned
as any other module.

In 1d with tp > 1 the tokens are split over tp: Megatron sequence parallelism (on by default)
gives each tp rank its chunk of the sequence inside a block, and the router and the experts
run on that chunk (each tp rank dispatches its own tokens over its ep group), so their weight
gradients are partial over tp and are summed over tp in the graph (``put_on_chunks``, called
by megatron_sp.py). Without sequence parallelism every tp rank routes and computes the whole
sequence of its replica, the same on each, and nothing is summed."""

from __future__ import annotations

from torch import nn

from shardzoo.layers.experts import ExpertsEP, is_experts
from shardzoo.parallel.replicated import sum_grads_over
from shardzoo.parallel.styles.base import Build, Style
from shardzoo.parallel.styles.whole import Replicate


class Experts(Style):
    """E experts -> this rank's E / ep of them (ep = 1: the module stays whole)."""

    name = "experts"
    needs = "a module with the experts contract: gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn, " \
            "forward(hidden, top_k_index, top_k_weights)"

    on_sequence_chunks = True  # its weight gradient is summed over tp (put_on_chunks)

    def accepts(self, module: nn.Module) -> bool:
        return is_experts(module)

    def put_on_chunks(self, module: nn.Module, mesh) -> None:
        """The tokens ``module`` (built or kept whole) reads are this tp rank's chunk: sum its
        weight gradient over tp."""
        if isinstance(module, ExpertsEP):
            module.sum_over_tp = True
        else:
            sum_grads_over(module, mesh.tp_group)

    def check_mesh(self, name: str, module: nn.Module, mesh, mode: str) -> None:
        """Raise unless ``module`` (planned as ``name``) splits over ``mesh``'s ep in ``mode``."""
        if mode != "1d":  # at ep=1 too: the experts, whole or split, read whole hidden vectors
            raise ValueError(f"{name}: ep={mesh.ep_size} with tp_mode={mode!r} is not built: the {mode} layout "
                             f"splits the hidden vectors an expert reads over its grid; experts work with "
                             f"tp_mode='1d' (any tp, with ep, dp, sp and ZeRO); use tp_mode='1d'")
        if mesh.ep_size == 1:
            return
        n_experts = module.gate_up_proj.shape[0]
        if n_experts % mesh.ep_size != 0:
            raise ValueError(f"{name}: ep={mesh.ep_size} does not divide the {n_experts} experts: each ep rank holds "
                             f"whole experts, n_experts / ep of them; use an ep that divides {n_experts}")

    def build(self, module: nn.Module, ctx: Build) -> nn.Module | None:
        if ctx.mesh.ep_size == 1:
            return None
        self.check_mesh(ctx.name, module, ctx.mesh, ctx.mode)
        return ExpertsEP.from_serial(module, ctx.mesh, device=module.gate_up_proj.device)


class Router(Replicate):
    """The module routing the tokens of a MoE block (transformers' ``ep_router``), whole on
    every rank; on sequence chunks its gradient is summed over tp (module doc)."""

    name = "router"
    on_sequence_chunks = True

    def put_on_chunks(self, module: nn.Module, mesh) -> None:
        sum_grads_over(module, mesh.tp_group)
