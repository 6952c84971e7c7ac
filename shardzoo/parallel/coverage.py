"""What a plan must cover before ``parallelize`` builds anything: every module whose input the
layout splits, and under tp every dropout drawing masks of its own.
"""

from __future__ import annotations

from torch import nn

from shardzoo.parallel.dropouts import is_dropout
from shardzoo.parallel.kinds import is_weighted_kind
from shardzoo.parallel.styles import covered_prefixes


def refuse_uncovered(model: nn.Module, planned: dict, layout, whole_tables: bool = False) -> None:
    """Every Linear, Conv1D, Embedding or norm (and, in the grid layouts, any module holding
    weights) must be covered by the plan: its input is split by the layout. With tp > 1 so
    must every dropout module with p > 0 (_refuse_dropout). ``whole_tables``: except, in 1d,
    an ``nn.Embedding``: it reads integer indices, which 1d never splits over tp, so kept
    whole it computes what it computes serially (as transformers keeps an unplanned one).
    Under sp that holds for a transformers model, whose ``position_ids`` the input hook makes
    global, not for a table of one's own that may be indexed by local positions."""
    covered = covered_prefixes(planned)
    for name, module in model.named_modules():
        if not name or name in planned or name.startswith(covered):
            continue
        _refuse_dropout(name, module, layout)
        if layout.mode == "1d" and isinstance(module, nn.Embedding):
            if whole_tables:
                continue
            if layout.mesh.sp_size > 1:
                raise ValueError(f"{name} (Embedding) is not in the plan; under sp={layout.mesh.sp_size} a table of a "
                                 f"module of one's own may be indexed by local positions 0..S/sp-1; plan it: "
                                 f"plan[{name!r}] = 'position_embedding' (positions), or 'vocab_embedding' / "
                                 f"'replicate' (token ids)")
        holds_weights = next(module.parameters(recurse=False), None) is not None
        if is_weighted_kind(module) or (holds_weights and layout.mode != "1d"):
            kind = type(module).__name__
            raise ValueError(f"{name} ({kind}) is not in the plan, and the {layout.mode} layout splits the "
                             f"activations it reads; add it to the plan: plan[{name!r}] = 'column' / 'row' / "
                             f"'norm' / 'embedding' ..., or 'replicate' to keep it whole on every rank")


def _refuse_dropout(name: str, module: nn.Module, layout) -> None:
    """torch's own dropout draws from each rank's generator with nothing keeping the tp ranks'
    draws equal, so a replicated activation could get other masks on other tp ranks and the
    replicas drift apart without an error. A p = 0 dropout draws nothing and is left alone."""
    if layout.mesh.tp_size == 1 or not is_dropout(module) or getattr(module, "p", 0.0) == 0.0:
        return
    kind = type(module).__name__
    fix = (f"plan it \"dropout\": plan[{name!r}] = 'dropout' (the layout's dropout: one mask on every tp rank where "
           f"the activation is replicated)") if isinstance(module, nn.Dropout) else \
        f"replace it by an nn.Dropout planned 'dropout', or plan it 'replicate' to keep torch's own draws"
    raise ValueError(f"{name} ({kind}, p={module.p}) is not in the plan; under tp={layout.mesh.tp_size} its masks are "
                     f"drawn by each rank alone and can differ between tp ranks holding the same activation; {fix}")
