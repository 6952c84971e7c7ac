"""Optimizer state as named, sharded tensors, so it reshards exactly like the parameters.

``optimizer.state_dict()`` numbers parameters by their position in ``param_groups``; here each
is named by ``model.named_parameters()``. A state tensor shaped like its parameter (AdamW's
``exp_avg`` / ``exp_avg_sq``) shares the parameter's ShardSpec and is saved as
``"<param>/<key>"`` pieces; any other tensor (AdamW's scalar ``step``) is saved whole, once;
plain numbers go into the index. Hyperparameters are saved per param group.

FSDP2 (a DTensor parameter): the state is a DTensor placed like the parameter and is saved as
the same rows (layers/dp_shard.py). ``ZeroRedundancyOptimizer`` keeps each parameter's state
on one rank of its group: that rank saves it, and a load fills only the parameters a rank
owns; an optimizer made of several (``zero_parts``: ZeRO 1 with experts, whose state is
partitioned over edp) is read part by part. The class recorded is the inner optimizer's, so
checkpoints move between ZeRO stages.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.safetensors_io import dtype_from_name
from shardzoo.checkpoint.tensors import LocalTensor
from shardzoo.layers.dp_shard import group_axes, like_param, local_tensor
from shardzoo.layers.shard_spec import tied_copies, unwrap_ddp


def _zero_parts(optimizer) -> list:
    """The ZeroRedundancyOptimizers keeping ``optimizer``'s state: itself, or the ``zero_parts``
    of an optimizer made of several (ZeRO 1 with expert parallelism: the dense parameters'
    partitioned over dp (x sp), the experts' over edp); [] for any other optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return [optimizer]
    return list(getattr(optimizer, "zero_parts", None) or [])


def _state_of(optimizer) -> dict:
    """Per-parameter state this rank holds (ZeroRedundancyOptimizer: its partition's)."""
    parts = _zero_parts(optimizer)
    if not parts:
        return optimizer.state
    return {p: s for part in parts for p, s in part.optim.state.items()}


def _class_name(optimizer) -> str:
    parts = _zero_parts(optimizer)
    return type(parts[0].optim if parts else optimizer).__name__


def _parts_by_param(optimizer) -> dict:
    """{id(parameter): the ZeroRedundancyOptimizer partitioning its state}."""
    return {id(p): part for part in _zero_parts(optimizer) for g in part.param_groups for p in g["params"]}


def _held_over(part, owner: LocalTensor) -> tuple[str, ...]:
    """Mesh axes over which ZeroRedundancyOptimizer ``part`` (None: none) partitions the state of
    parameter ``owner``: dp / sp, or edp for a tensor split over ep."""
    if part is None or owner.mesh is None:
        return ()
    experts = owner.spec is not None and "ep" in owner.spec.partitioned_over
    try:
        return group_axes(part.process_group, owner.mesh, experts)
    except ValueError as e:
        raise CheckpointError(f"ZeroRedundancyOptimizer: {e}; build it over the model's dp (x sp) group "
                              f"(shardzoo.zero_optimizer)") from e


def _param_names(model: nn.Module, optimizer) -> list[list[str]]:
    """Names of the optimizer's parameters, per param group."""
    copies = tied_copies(unwrap_ddp(model))  # an untied copy of a tied table saves as the table (tensors.py)
    names = {id(p): copies.get(n, n) for n, p in unwrap_ddp(model).named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"param group {g} of the optimizer holds a parameter of shape {tuple(p.shape)} that "
                                      f"is not a parameter of the model; build the optimizer from model.parameters()")
            group_names.append(names[id(p)])
        out.append(group_names)
    return out


def _json_value(v):
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN / infinity
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    return None  # not representable; the current optimizer's value is kept on load


def optimizer_tensors(model: nn.Module, optimizer, model_tensors: list[LocalTensor]) -> tuple[list[LocalTensor], dict]:
    """This rank's optimizer-state tensors and the JSON part (groups, numbers, which are param-shaped)."""
    by_name = {lt.name: lt for lt in model_tensors}
    group_names = _param_names(model, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    flat_names = [n for names in group_names for n in names]
    out: list[LocalTensor] = []
    values: dict[str, dict] = {}
    shaped_names: dict[str, bool] = {}
    state = _state_of(optimizer)
    parts = _parts_by_param(optimizer)
    for p, name in zip(params, flat_names):
        owner = by_name[name]
        held = _held_over(parts.get(id(p)), owner)
        for key, v in state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                tname = f"{name}/{key}"
                shaped = v.dim() > 0 and tuple(v.shape) == tuple(p.shape)
                shaped_names[tname] = shaped
                out.append(LocalTensor(tname, local_tensor(v).detach(), owner.spec if shaped else None, owner.mesh,
                                       held))
            else:
                values.setdefault(name, {})[key] = _json_value(v)
    groups = [{"options": {k: _json_value(v) for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(optimizer.param_groups, group_names)]
    return out, {"class": _class_name(optimizer), "param_groups": groups, "values": values,
                 "like_param": shaped_names}


def merge_metas(metas: list[dict]) -> dict:
    """One optimizer description from every rank's (pipeline stages hold different params)."""
    merged = {"class": metas[0]["class"], "param_groups": [], "values": {}, "like_param": {}}
    for meta in metas:
        for g, group in enumerate(meta["param_groups"]):
            if g == len(merged["param_groups"]):
                merged["param_groups"].append({"options": group["options"], "params": []})
            known = merged["param_groups"][g]["params"]
            known.extend(n for n in group["params"] if n not in known)
        merged["values"].update(meta["values"])
        merged["like_param"].update(meta["like_param"])
    return merged


def _same_kind(current, saved) -> bool:
    """Whether a saved option value (JSON) may replace the optimizer's ``current`` one."""
    number = (int, float, torch.Tensor)
    if isinstance(current, bool) or isinstance(saved, bool):
        return isinstance(current, bool) and isinstance(saved, bool)
    if isinstance(current, number) or current is None:
        return isinstance(saved, (int, float)) if current is not None else True
    if isinstance(current, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(current) and all(_same_kind(c, x) for c, x in zip(current, saved))
    return isinstance(saved, type(current))


def load_optimizer(model: nn.Module, optimizer, saved: dict, model_tensors: list[LocalTensor], read) -> None:
    """Fill ``optimizer`` from the checkpoint's optimizer section.

    ``read(lt, entry)`` fills LocalTensor ``lt`` from index entry ``entry`` (the piece reader)."""
    if _class_name(optimizer) != saved["class"]:
        raise CheckpointError(f"the checkpoint holds {saved['class']} state but the optimizer is {_class_name(optimizer)}; "
                              f"build the same optimizer class, or load the model alone (optimizer=None)")
    by_name = {lt.name: lt for lt in model_tensors}
    copies = tied_copies(unwrap_ddp(model))
    params = {copies.get(n, n): p for n, p in unwrap_ddp(model).named_parameters()}
    owned = None  # ZeroRedundancyOptimizer: only this rank's partition is read
    if _zero_parts(optimizer):
        owned = {id(p) for part in _zero_parts(optimizer) for g in part.optim.param_groups for p in g["params"]}
    group_names = _param_names(model, optimizer)
    if len(group_names) > len(saved["param_groups"]):
        raise CheckpointError(f"the optimizer has {len(group_names)} param groups; the checkpoint has "
                              f"{len(saved['param_groups'])}. Group the parameters as when saving")
    by_param: dict[str, list[tuple[str, dict]]] = {}
    for tname, entry in saved["tensors"].items():
        pname, _, key = tname.rpartition("/")
        by_param.setdefault(pname, []).append((key, entry))
    state: dict[int, dict] = {}
    groups = []
    index = 0
    for g, (group, names) in enumerate(zip(optimizer.param_groups, group_names)):
        saved_group = saved["param_groups"][g]
        stray = [n for n in names if n not in saved_group["params"]]
        if stray:
            raise CheckpointError(f"parameters {stray[:5]} are in optimizer param group {g} but not in the saved group {g}; "
                                  f"group the parameters as when saving")
        options = {k: v for k, v in group.items() if k != "params"}
        for k, v in saved_group["options"].items():
            if k in options and v is not None:
                if not _same_kind(options[k], v):
                    raise CheckpointError(f"checkpoint index, optimizer.param_groups[{g}].options[{k!r}] is "
                                          f"{type(v).__name__}, but the optimizer's {k} is {type(options[k]).__name__}; "
                                          f"the index was edited or was saved from another optimizer")
                options[k] = tuple(v) if isinstance(options[k], tuple) else v
        groups.append({**options, "params": list(range(index, index + len(names)))})
        for name in names:
            owner = by_name[name]
            if owned is not None and id(params[name]) not in owned:
                index += 1
                continue
            param_state = dict(saved["values"].get(name, {}))
            for key, entry in by_param.get(name, []):
                dtype = dtype_from_name(entry["dtype"])
                if entry.get("like_param"):  # this rank's piece, cut like the parameter
                    lt = LocalTensor(f"{name}/{key}", torch.zeros(owner.tensor.shape, dtype=dtype), owner.spec, owner.mesh)
                else:
                    lt = LocalTensor(f"{name}/{key}", torch.zeros(entry["shape"], dtype=dtype), None, owner.mesh)
                read(lt, entry)
                param_state[key] = like_param(lt.tensor, params[name]) if entry.get("like_param") else lt.tensor
            if param_state:
                state[index] = param_state
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": groups})
