"""ZeRO 1 with expert parallelism: one optimizer made of two ZeroRedundancyOptimizers.

A dense parameter is the same on every rank of the dp (x sp) group, so torch's
``ZeroRedundancyOptimizer`` partitions its state there and broadcasts the updated parameter
from its owner. An expert parameter (layers/experts.py) differs along ep and is the same only
over the expert data parallel group edp, so a second ``ZeroRedundancyOptimizer`` partitions the
experts' state over edp and broadcasts an updated expert within edp only (one over dp x sp
would overwrite a rank's experts with another ep rank's).

:class:`ExpertZeroOptimizer` is the one object the user steps: its ``param_groups`` are those
of the plain optimizer over the same parameters (LR schedulers and gradient clipping see one
optimizer), and before each step their options are copied into the parts' groups, as
ZeroRedundancyOptimizer copies its own into its local optimizer. ``state`` is this rank's:
the state of the dense and expert parameters its two partitions own. ``zero_parts`` lists the
two engines (shardzoo.checkpoint saves each parameter's state from the rank that owns it, over
the group of the part that holds the parameter).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


class ExpertZeroOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, its state partitioned by two
    ``ZeroRedundancyOptimizer`` s: the parameters whose ids are in ``experts`` over
    ``expert_group`` (edp), the others over ``dense_group`` (dp, or dp x sp). ``defaults``: the
    options of ``optimizer_class`` (``lr=...``). Built by :func:`shardzoo.zero_optimizer`."""

    def __init__(self, params, optimizer_class: type, dense_group, expert_group, experts: set[int], **defaults: Any):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        super().__init__(params, defaults)
        self.parts: list[tuple[ZeroRedundancyOptimizer, list[int]]] = []  # (engine, outer group of each inner)
        for process_group, expert in ((dense_group, False), (expert_group, True)):
            inner, where = [], []
            for g, group in enumerate(self.param_groups):
                mine = [p for p in group["params"] if (id(p) in experts) == expert]
                if mine:
                    inner.append({**_options(group), "params": mine})
                    where.append(g)
            if inner:
                self.parts.append((ZeroRedundancyOptimizer(inner, optimizer_class, process_group=process_group,
                                                           **defaults), where))
        self._options_from_parts()  # the inner optimizer's own defaults (betas, weight_decay, ...)

    @property
    def zero_parts(self) -> list:
        """The ZeroRedundancyOptimizers behind this optimizer (dense first, then experts)."""
        return [zero for zero, _ in self.parts]

    @property
    def state(self) -> dict:
        """This rank's state: {parameter: its state} for the parameters its partitions own."""
        merged: dict = {}
        for zero, _ in getattr(self, "parts", ()):
            merged.update(zero.optim.state)
        return merged

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ (and its load_state_dict) assign the state; the parts hold it
        pass

    def _options_from_parts(self) -> None:
        for zero, where in self.parts:
            for inner, g in zip(zero.param_groups, where):
                self.param_groups[g].update(_options(inner))

    def _options_to_parts(self) -> None:
        for zero, where in self.parts:
            for inner, g in zip(zero.param_groups, where):
                inner.update(_options(self.param_groups[g]))

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "parts", None) is not None:
            raise ValueError("ExpertZeroOptimizer partitions its parameters over two groups when it is built; it "
                             "takes no param group afterwards. Build it with every parameter "
                             "(shardzoo.zero_optimizer(model, ...))")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One step of every part: each updates the parameters it owns and broadcasts them over
        its group (dense: dp (x sp); experts: edp). Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._options_to_parts()  # an LR scheduler writes into this optimizer's groups
        for zero, _ in self.parts:
            zero.step()
        self._options_from_parts()
        return loss

    def state_dict(self) -> dict:
        raise RuntimeError("ExpertZeroOptimizer holds the experts' state on the ranks of each ep group, so no rank "
                           "has a whole state_dict(); save it with shardzoo.checkpoint.save(model, path, optimizer) "
                           "(each rank writes what it owns) and load it with shardzoo.checkpoint.load")

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``{"state": {index: state}, "param_groups": [...]}`` indexed as
        ``torch.optim.Optimizer.state_dict`` indexes this optimizer's parameters (any subset of
        the state; each part keeps the parameters its rank owns)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError(f"the state dict has param groups of {[len(s['params']) for s in saved_groups]} "
                             f"parameters; this optimizer's hold {[len(g['params']) for g in self.param_groups]}. "
                             f"Load the state of an optimizer built over the same parameters")
        index_of = {id(p): i for s, g in zip(saved_groups, self.param_groups) for i, p in zip(s["params"], g["params"])}
        for saved, group in zip(saved_groups, self.param_groups):
            group.update(_options(saved))
        for zero, where in self.parts:
            state, groups, n = {}, [], 0
            for inner, g in zip(zero.param_groups, where):
                groups.append({**_options(self.param_groups[g]), "params": list(range(n, n + len(inner["params"])))})
                for p in inner["params"]:
                    if index_of[id(p)] in state_dict["state"]:
                        state[n] = state_dict["state"][index_of[id(p)]]
                    n += 1
            zero.load_state_dict({"state": state, "param_groups": groups})
