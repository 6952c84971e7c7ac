"""Megatron 1D tensor-parallel linear layer: column and row styles, optional sequence parallelism.

Weights use ``nn.Linear``'s ``[out_features, in_features]`` layout, so every ShardSpec's
global shape is the serial shape and ``full_state_dict`` returns ``nn.Linear`` names / shapes.

=========== ================================ ======================================= =========================
style       weight / bias on a rank          forward communication                   backward communication
=========== ================================ ======================================= =========================
column      W[out/p, in], b[out/p]           copy_to (none); SP: all_gather seq dim  all_reduce dX; SP: reduce_scatter
            (gather_output: gather_from on the last dim)
row         W[out, in/p], b[out] replicated  reduce_from (all_reduce); SP:            none; SP: all_gather
                                             reduce_scatter seq dim
            (input_is_parallel=False: scatter_to of the full input on the last dim)
=========== ================================ ======================================= =========================

The column layer starts its backward all-reduce (reduce-scatter) of dX before computing dW, so
the two overlap (``column_linear.py``). A column layer followed by a row layer (an MLP,
attention) costs one all-reduce forward and one backward; with sequence parallelism the all-reduce becomes an all-gather + a reduce-scatter of
the same total volume, and everything between two such pairs holds ``seq/p`` tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardzoo.comm import collectives as comm
from shardzoo.layers.column_linear import column_linear
from shardzoo.layers.module import ParallelModule
from shardzoo.layers.common_1d import (
    SEQ_DIM,
    enter_sequence_parallel,
    leave_sequence_parallel,
    local_param,
    replicated_spec,
    require_divisible,
    require_sequence_placement,
    split_spec,
    tp_sum_grad,
)

STYLES = ("column", "row")


class ParallelLinear1D(ParallelModule):
    """``y = x W^T + b`` with W split over the tp group.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        mesh: the ParallelMesh; the tp axis is used.
        style: "column" splits out_features, "row" splits in_features.
        gather_output: column only; return the full ``[..., out]`` instead of ``[..., out/p]``.
        input_is_parallel: row only; False accepts a full ``[..., in]`` input and keeps this
            rank's ``[..., in/p]`` slice (default True: the input is a column layer's output).
        sequence_parallel: activations outside the pair are ``[batch, seq/p, hidden]``.
            Column: input ``[b, s/p, in]``; row: output ``[b, s/p, out]``.
        dtype, device: of the parameters. Initialisation draws the full ``nn.Linear`` on CPU
            from the current torch RNG (same calls and order as serial) and keeps this slice.

    Shapes (p = tp size, s_in = s/p under sequence parallelism, else s):
        column: ``[b, s_in, in] -> [b, s, out/p]`` (``[b, s, out]`` with gather_output)
        row:    ``[b, s, in/p] -> [b, s_out, out]`` (input ``[b, s, in]`` if not input_is_parallel)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mesh,
        style: str = "column",
        gather_output: bool = False,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self._check(in_features, out_features, mesh, style, gather_output, input_is_parallel)
        serial = nn.Linear(in_features, out_features, bias, dtype=dtype)
        self._setup(serial, mesh, device, style=style, gather_output=gather_output,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel)

    @staticmethod
    def _check(in_features: int, out_features: int, mesh, style: str, gather_output: bool,
               input_is_parallel: bool) -> None:
        name = f"ParallelLinear1D(style={style!r})"
        if style not in STYLES:
            raise ValueError(f"ParallelLinear1D style={style!r} is not one of {STYLES}; use 'column' or 'row'")
        if style == "row" and gather_output:
            raise ValueError(f"{name} has no gather_output (its output is already full); use it with style='column'")
        if style == "column" and not input_is_parallel:
            raise ValueError(f"{name} always takes the full input; input_is_parallel=False is for style='row'")
        require_divisible(name, "out_features" if style == "column" else "in_features",
                          out_features if style == "column" else in_features, mesh.tp_size)

    def _setup(self, serial: nn.Linear, mesh, device, style: str = "column", gather_output: bool = False,
               input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        in_features, out_features = serial.in_features, serial.out_features
        self._check(in_features, out_features, mesh, style, gather_output, input_is_parallel)
        split_dim = 0 if style == "column" else 1
        self.in_features, self.out_features = in_features, out_features
        self.mesh, self.style = mesh, style
        self.output_gathered, self.input_is_parallel = gather_output, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence = None  # a model's SequenceShards (sequence_shards.py), set by use_sequence_shards
        device = device if device is not None else serial.weight.device
        local_param(self, "weight", serial.weight, split_spec((out_features, in_features), split_dim, mesh), device)
        bias_spec = split_spec((out_features,), 0, mesh) if style == "column" else replicated_spec((out_features,))
        local_param(self, "bias", serial.bias, bias_spec, device)

    def use_sequence_shards(self, shards) -> None:
        """Run between a model's sequence-sharded blocks (sequence_shards.py): a column layer
        reads ``shards.gather(x)`` of a chunk ``x`` (one all-gather shared by the column layers
        reading ``x``; an input gathered already is used as it is, a replicated one as without
        shards), a row layer reduce-scatters into ``shards.scatter``; both pad a sequence tp
        does not divide."""
        if self.output_gathered or not self.input_is_parallel:
            raise ValueError(f"{self!r}: a layer with gather_output=True or input_is_parallel=False cannot run "
                             f"between sequence-sharded blocks; turn sequence_parallel off")
        self.sequence, self.sequence_parallel = shards, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.mesh.tp_group
        if self.sequence is not None:
            return self._forward_shards(x)
        if self.sequence_parallel:
            require_sequence_placement("ParallelLinear1D", x)
        if self.style == "column":
            y = column_linear(x, self.param("weight"), self.param("bias"), group, self.sequence_parallel)
            return comm.gather_from(y, group, -1) if self.output_gathered else y
        if not self.input_is_parallel:
            x = comm.scatter_to(x, group, -1)
        y = F.linear(x, self.param("weight"))
        # y is this matmul's fresh output, read by nothing else: sum it in place
        y = comm.reduce_scatter(y, group, SEQ_DIM) if self.sequence_parallel else comm.reduce_from(y, group, inplace=True)
        if self.bias is not None:  # added once, after the sum; in y's dtype, as nn.Linear under autocast
            y = y + tp_sum_grad(self.param("bias"), self.mesh, self.sequence_parallel).to(y.dtype)
        return y

    def _forward_shards(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            shards = self.sequence
            if not shards.is_gathered(x) and not shards.holds_chunk(x):  # a replicated input: as without shards
                return column_linear(x, self.param("weight"), self.param("bias"), self.mesh.tp_group, False)
            # the gather's backward sums this rank's dX of every reader, then reduce-scatters
            full = x if shards.is_gathered(x) else shards.gather(x)
            return F.linear(full, self.param("weight"), self.param("bias"))
        y = self.sequence.scatter(F.linear(x, self.param("weight")))
        if self.bias is not None:  # a partial gradient over tp: summed with its block's others
            y = y + self.sequence.partial_grads.summed(self, "bias", self.param("bias")).to(y.dtype)
        return y

    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """Full replicated input ``[b, s, in]`` -> what ``forward`` takes on this rank."""
        if self.style == "column":
            return enter_sequence_parallel(x_full, self.mesh) if self.sequence_parallel else x_full
        return comm.scatter_to(x_full, self.mesh.tp_group, -1) if self.input_is_parallel else x_full

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """This rank's ``forward`` output -> the full replicated ``[b, s, out]``."""
        if self.style == "column":
            return y_local if self.output_gathered else comm.gather_from(y_local, self.mesh.tp_group, -1)
        return leave_sequence_parallel(y_local, self.mesh) if self.sequence_parallel else y_local

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"style={self.style!r}, tp={self.mesh.tp_size}, gather_output={self.output_gathered}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")
