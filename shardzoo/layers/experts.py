"""Experts split over the mesh's ep axis (expert parallelism), for any module with transformers'
experts contract: ``gate_up_proj`` [E, 2I, H] (gate rows first, then up), ``down_proj``
[E, H, I], ``act_fn`` and ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])
-> [T, H]`` = sum over k of weight * down(act(gate(x)) * up(x)) of expert top_k_index[t, k].

:class:`ExpertsEP` keeps this rank's ``E / ep`` experts (ShardSpec over "ep") and runs the
tokens of every rank of its ep group through them with the dropless all-to-all dispatch
(expert_dispatch.py). The local experts compute with one grouped matmul per projection
(``torch._grouped_mm``) where torch has it for the dtype and the row strides are 16-byte
aligned, else with a loop over the local experts.

Gradients: every rank's loss carries the factor R = dp*sp of the global-mean loss
(layers/batch_loss.py), and an expert's gradient gathers the tokens of the ep ranks, so the
expert weights' gradient is scaled by 1/ep in the graph (the tokens' gradients are not) and
then averaged over the edp group: by a hook on the gradient here, by FSDP2 over edp when
``data_parallel`` shards the experts (``reduced_by_fsdp``), or once per step by a pipeline
after its schedule (``reduced_per_step``). The result is the serial gradient
of the whole batch, as for every other parameter after ``data_parallel``.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.comm import copy_to, ops
from shardzoo.layers.expert_dispatch import run_experts
from shardzoo.layers.grad_fns import contiguous_grad, scale_grad
from shardzoo.layers.module import ParallelModule
from shardzoo.layers.shard_spec import ShardSpec, shard_param

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` has transformers' experts contract (module doc), in the layout it
    describes: concatenated gate|up, not transposed, no biases."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
            or down.dim() != 3 or not callable(getattr(module, "act_fn", None)):
        return False
    e, two_i, h = gate_up.shape
    layout_ok = not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True) \
        and not getattr(module, "has_bias", False) and getattr(module, "has_gate", True)
    return layout_ok and two_i % 2 == 0 and tuple(down.shape) == (e, h, two_i // 2)


def grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these: a dtype it takes, rows of 16-byte multiples."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in _GROUPED_DTYPES or x.shape[0] == 0:
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (gate_up.shape[-1], down.shape[-1], gate_up.shape[-2]))


def expert_mlp(x: torch.Tensor, sizes: list[int], gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """Rows ``x`` [R, H] in expert order (``sizes[e]`` rows for local expert e) through their
    experts ``gate_up`` [n, 2I, H], ``down`` [n, H, I]: down(act(gate) * up) -> [R, H]."""
    if grouped_ok(x, gate_up, down):
        offsets = torch.cumsum(torch.tensor(sizes, device=x.device), 0).to(torch.int32)
        h = contiguous_grad(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets))
        gate, up = h.chunk(2, dim=-1)
        return contiguous_grad(torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offsets))
    outs = []
    for e, rows in enumerate(x.split(sizes)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs) if outs else x[:0]


class ExpertsEP(ParallelModule):
    """This rank's ``E / ep`` experts of a module with the experts contract, fed by the dropless
    all-to-all dispatch over ``mesh.group("ep")``: ``forward(hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H]``, the serial module's output for this rank's tokens.

    ``capacity_factor``: None (default) drops nothing; a float keeps, per rank and expert, at
    most ``ceil(capacity_factor * T * K / E)`` of this rank's pairs (the rest add zero)."""

    def _setup(self, serial: nn.Module, mesh, device=None, capacity_factor: float | None = None):
        if not is_experts(serial):
            raise ValueError(f"{type(serial).__name__} does not have the experts contract (gate_up_proj [E, 2I, H], "
                             f"down_proj [E, H, I], act_fn); split it with another style")
        n_experts = serial.gate_up_proj.shape[0]
        ep = mesh.ep_size
        if n_experts % ep != 0:
            raise ValueError(f"ep={ep} does not divide the {n_experts} experts of {type(serial).__name__}: each ep rank "
                             f"holds whole experts, n_experts / ep of them; use an ep that divides {n_experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor!r} must be positive (or None: drop no token)")
        self.mesh, self.n_experts, self.capacity_factor = mesh, n_experts, capacity_factor
        self.act_fn = serial.act_fn
        self.reduced_by_fsdp = False  # data_parallel sets it when FSDP2 averages over edp
        self.reduced_per_step = False  # a pipeline sets it: it averages over edp once, after its schedule
        self.sum_over_tp = False  # set when its tokens are this tp rank's sequence chunk (styles/experts.py)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(serial, name)
            spec = ShardSpec.split(tuple(full.shape), {0: (mesh.ep_rank, ep)}, partitioned_over=("ep",))
            shard_param(self, name, full, spec, device)
        self._hooked: dict[int, weakref.ref] = {}

    @property
    def num_experts(self) -> int:
        """The experts this rank holds (transformers' attribute name)."""
        return self.gate_up_proj.shape[0]

    def _average_over_edp(self) -> None:
        """Hook each expert parameter's gradient to be averaged over edp (once per object)."""
        group, size = self.mesh.group("edp"), self.mesh.size("edp")
        if size == 1 or self.reduced_by_fsdp or self.reduced_per_step:
            return
        for p in (self.gate_up_proj, self.down_proj):
            seen = self._hooked.get(id(p))
            if (seen is not None and seen() is p) or not p.requires_grad:
                continue
            p.register_hook(lambda g: ops.all_reduce(g, group).div_(size))
            self._hooked[id(p)] = weakref.ref(p)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self._average_over_edp()
        ep = self.mesh.ep_size
        capacity = None
        if self.capacity_factor is not None:
            capacity = max(1, math.ceil(self.capacity_factor * top_k_index.numel() / self.n_experts))

        gate_up, down = self.gate_up_proj, self.down_proj
        if self.sum_over_tp:  # each tp rank saw its chunk of the tokens: the gradients are partial
            gate_up, down = copy_to(gate_up, self.mesh.tp_group), copy_to(down, self.mesh.tp_group)

        def compute(rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            rows = scale_grad(rows, float(ep))  # the tokens' gradient unscaled ...
            out = expert_mlp(rows, sizes, gate_up, down, self.act_fn)
            return scale_grad(out, 1.0 / ep)  # ... the experts' by 1/ep (module doc)

        return run_experts(hidden, top_k_index, top_k_weights, self.n_experts, self.mesh.group("ep"), compute,
                           capacity)

    def extra_repr(self) -> str:
        return f"experts {self.num_experts} of {self.n_experts}, ep={self.mesh.ep_size}"
