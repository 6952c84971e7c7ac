"""Hugging Face directories in and out of a parallelized transformers model.

``from_pretrained(model_dir, mesh, plan=None, *, dtype=None)`` builds the model from its
``config.json`` with every parameter on the meta device (buffers, such as RoPE's, are computed
as usual), parallelizes it, gives each parameter storage of its local shape, and fills it with
this rank's slices of the safetensors files, read through the checked readers of
``shardzoo.checkpoint`` (headers, sizes and names checked before anything is read). So a rank
holds its own shard and, while it copies, at most one block of file pages (``_CHUNK_BYTES``),
never the model.

``save_pretrained(model, out_dir)`` gathers the full tensors (collective), and rank 0 hands them
to a serial twin built on the meta device, whose own ``save_pretrained`` writes the directory
transformers loads (config, tied weights, safetensors), into a temporary directory renamed into
place.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import uuid

import torch
import torch.distributed as dist
from torch import nn

from shardzoo.checkpoint.errors import CheckpointError
from shardzoo.checkpoint.hf_files import HFWeights
from shardzoo.checkpoint.hf_stacked import StackedSource, read_stacked, stacked_shape
from shardzoo.checkpoint.sync import Ranks, describe
from shardzoo.checkpoint.tensors import fill_local, model_tensors
from shardzoo.parallel.stage_state import full_state_dict
from shardzoo.layers.shard_spec import unwrap_ddp
from shardzoo.models.hf_key_map import file_sources
from shardzoo.models.meta import materialize
from shardzoo.models.pretrained import config_json
from shardzoo.parallel import parallelize

_TIMEOUT = datetime.timedelta(minutes=10)  # how long a rank waits for the others to finish reading / writing


@contextlib.contextmanager
def parameters_on_meta():
    """Inside, every parameter a module registers is moved to the meta device as it is
    registered (torch's module-registration hook): the model's own init then costs nothing,
    and its buffers are computed on the CPU as usual."""
    def to_meta(module, name, param):
        if param is not None and not param.is_meta:
            return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return None

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def read_config(model_dir: str):
    """The transformers config of ``model_dir``, its config.json parsed by shardzoo's strict
    JSON reader first (a missing directory or file, bad JSON, no ``model_type``: CheckpointError)."""
    import transformers

    path, raw = config_json(model_dir)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise CheckpointError(f"{path}: 'model_type' must name a transformers model type; got {model_type!r}")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(model_type, **fields)


def _model_class(config):
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return None


def build_on_meta(config, dtype=None) -> nn.Module:
    """The transformers model of ``config`` with its parameters on the meta device."""
    import transformers

    cls = _model_class(config)
    with parameters_on_meta():
        model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype) if dtype is not None else model


def from_pretrained(model_dir: str, mesh, plan: dict | None = None, *, dtype: torch.dtype | None = None,
                    sp_mode: str = "ring", device=None, check_inputs: str = "first", **parallelize_kwargs) -> nn.Module:
    """A transformers model from ``model_dir`` parallelized over ``mesh`` (module docstring),
    each rank reading only its slices. Collective. ``dtype``: of the parameters (default the
    torch default, as transformers); ``device``: of the storage (default: CPU);
    ``check_inputs`` and ``parallelize_kwargs`` (``stages=``, ``virtual_stages=``,
    ``checkpointing=`` ...): as :func:`shardzoo.parallelize`'s. With pp > 1 a rank builds,
    allocates and reads its own stages only."""
    config = read_config(model_dir)
    model = parallelize(build_on_meta(config, dtype), mesh, plan, sp_mode=sp_mode, check_inputs=check_inputs,
                        **parallelize_kwargs)
    materialize(model, device or "cpu")
    load_weights(model, model_dir)
    return model


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Fill every parameter and persistent buffer of a parallelized ``model`` with its slices of
    the weights in ``model_dir`` (names as the file's). Collective; any rank's failure raises on
    every rank, naming what is missing or mis-shaped."""
    ranks = Ranks(_TIMEOUT)
    what = f"loading {model_dir}"
    error, weights, local = None, None, []
    try:
        weights = HFWeights(model_dir)
        local, _ = model_tensors(model)
        weights.sources = file_sources(unwrap_ddp(model), [lt.name for lt in local], weights.entries)
        problems = [_problem(lt, weights) for lt in local]
        problems = [p for p in problems if p]
        if problems:
            raise CheckpointError(f"{model_dir} does not fit {type(model).__name__}:\n" + "\n".join(problems[:20]))
    except Exception as e:
        error = describe(e)
    ranks.agree(error, what)
    error = None
    try:
        for lt in local:
            fill_local(lt, lambda box, out, lt=lt: _copy_in_chunks(weights, lt, box, out))
    except Exception as e:
        error = describe(e)
    ranks.agree(error, what)


_CHUNK_BYTES = 4 << 20  # the most file pages one read keeps mapped while it is copied


def _copy_in_chunks(weights: HFWeights, lt, box, out: torch.Tensor) -> None:
    """Copy box ``box`` of ``lt``'s global tensor into ``out``: straight from the file where the
    box is whole rows in ``out``'s dtype (``HFWeights.read_rows_into``), else a block of
    leading-dim rows at a time, each from its own read. A read returns a view of a fresh memory map of the file, whose
    pages count in this rank's memory until the view is dropped; one read of the whole box would
    hold as many file pages as the rank's piece of its largest tensor (an embedding) on top of
    the piece itself."""
    source = _source(weights, lt.name)
    plain = lt.spec is None or not lt.spec.serial_shape
    if plain and isinstance(source, str) and weights.read_rows_into(source, box, out):
        return
    offsets, shape = box
    row_bytes = out[0].numel() * out.element_size() if out.dim() else 0
    if not shape or row_bytes * shape[0] <= _CHUNK_BYTES:
        out.copy_(_read(weights, lt, box))
        return
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, shape[0], step):
        n = min(step, shape[0] - start)
        out[start:start + n].copy_(_read(weights, lt, ((offsets[0] + start, *offsets[1:]), (n, *shape[1:]))))


def _serial_shape(lt) -> tuple[int, ...]:
    return tuple(lt.spec.serial_shape) if lt.spec is not None and lt.spec.serial_shape else lt.global_shape


def _source(weights: HFWeights, name: str):
    """Where the files hold model tensor ``name``: its own key, a renamed one, or a
    StackedSource of per-expert tensors (hf_key_map.py); None when nowhere."""
    source = weights.sources.get(name, name)
    return source if isinstance(source, StackedSource) or source in weights.entries else None


def _file_shape(weights: HFWeights, source) -> tuple[int, ...]:
    return stacked_shape(weights, source) if isinstance(source, StackedSource) else tuple(weights.shape(source))


def _read_source(weights: HFWeights, source, box) -> torch.Tensor:
    return read_stacked(weights, source, box) if isinstance(source, StackedSource) else weights.read(source, box)


def _problem(lt, weights: HFWeights) -> str | None:
    source = _source(weights, lt.name)
    if source is None:
        return f"missing from the files: {lt.name}"
    if _file_shape(weights, source) != _serial_shape(lt):
        return f"{lt.name}: the files hold {list(_file_shape(weights, source))}, the model {list(_serial_shape(lt))}"
    return None


def _read(weights: HFWeights, lt, box) -> torch.Tensor:
    """Box ``box`` of ``lt``'s global tensor; a packed tensor (spec.serial_shape) is read part by
    part from the serial [.., K n, ..] tensor its global [.., K, n, ..] views."""
    source = _source(weights, lt.name)
    if lt.spec is None or not lt.spec.serial_shape:
        return _read_source(weights, source, box)
    offsets, shape = box
    dim = next(d for d, (g, s) in enumerate(zip(lt.spec.global_shape, lt.spec.serial_shape)) if g != s)
    n = lt.spec.global_shape[dim + 1]
    pieces = []
    for k in range(offsets[dim], offsets[dim] + shape[dim]):
        o = offsets[:dim] + (k * n + offsets[dim + 1],) + offsets[dim + 2:]
        s = shape[:dim] + (shape[dim + 1],) + shape[dim + 2:]
        pieces.append(_read_source(weights, source, (o, s)))
    return torch.stack(pieces, dim)


def save_pretrained(model: nn.Module, out_dir: str) -> None:
    """Write the full model as a Hugging Face directory transformers loads (module docstring).
    Collective: every rank calls it; rank 0 writes."""
    model = unwrap_ddp(model)
    state = model.__dict__.get("_shardzoo_parallel")
    if state is None or not state.hf:
        raise ValueError(f"save_pretrained takes a transformers model made by shardzoo.parallelize or "
                         f"shardzoo.from_pretrained; got {type(model).__name__}")
    full = full_state_dict(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0:
        try:
            _write(model, full, os.fspath(out_dir))
        except Exception as e:
            error = describe(e)
    Ranks(_TIMEOUT).agree(error, f"saving {out_dir}")


def _write(model: nn.Module, full: dict[str, torch.Tensor], out_dir: str) -> None:
    serial = build_on_meta(model.config.__class__.from_dict(model.config.to_dict()))
    serial.load_state_dict(full, strict=False, assign=True)
    if hasattr(serial, "tie_weights"):
        serial.tie_weights()
    still_meta = [n for n, p in serial.named_parameters() if p.is_meta]
    if still_meta:
        raise CheckpointError(f"save_pretrained: no full tensor for {still_meta[:5]}; the model's parameters and its "
                              f"transformers class do not match")
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        serial.save_pretrained(tmp, safe_serialization=True)
        if os.path.isdir(out_dir):
            old = f"{tmp}.old"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)

