"""Attention heads under a tp layout: whole heads per rank, grouped-query kv heads, and the head
counts attention code reads made local.

The projections of an attention module are split along the head axis of the layout (1d: tp;
the grids: the axis splitting the projection's output features, q parts). With P parts,
n heads and n_kv kv heads:

* n % P != 0 is refused;
* n_kv % P == 0: the kv projections split like the q projections;
* P % n_kv == 0 (more parts than kv heads): each rank holds the one kv head its q heads read.
  The kv weight is built as ``repeat_interleave(P / n_kv)`` of the serial one, so ranks along
  the head axis hold copies; their ShardSpecs point at the same rows of the serial tensor
  (checkpoints and ``full_state_dict`` give the serial shapes) and their gradients are summed
  (layers/replica_grads.py);
* anything else is refused, naming heads, kv heads and the tp values that work.

Head counts: where the attention module (or its ``config``) holds a head count or a width
(``num_heads``, ``num_key_value_heads``, ``num_key_value_groups``, ``embed_dim``, ...), it
is set to the local value, so ``view(b, s, self.num_heads, d)`` sees this rank's heads. An
integer attribute that names heads but is not one of those is refused: its meaning is unknown,
and a wrong count could reshape silently.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn


HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
WIDTH_ATTRS = ("embed_dim", "hidden_size", "all_head_size", "split_size", "inner_dim")
GROUP_ATTRS = ("num_key_value_groups", "num_kv_groups")
COLUMN_STYLES = ("column", "packed_column", "head_fused_column")
_MARKERS = HEAD_ATTRS + GROUP_ATTRS + ("head_dim",)


@dataclass
class AttentionHeads:
    """One attention module: its global head counts, the head parts of the layout, and which
    planned projections carry q heads and which kv heads."""

    name: str
    module: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    parts: int
    axis: str
    kv_projections: set = field(default_factory=set)
    packed: dict = field(default_factory=dict)  # projection name -> parts (q|k|v: 3)

    @property
    def local_heads(self) -> int:
        return self.heads // self.parts

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.parts if self.kv_heads % self.parts == 0 else 1

    @property
    def replicated_kv(self) -> bool:
        return self.kv_heads % self.parts != 0


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = module.__dict__.get(n)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _looks_like_attention(module: nn.Module) -> bool:
    return any(n in module.__dict__ for n in _MARKERS) or "attention" in type(module).__name__.lower()


def attention_modules(model: nn.Module, planned: dict, layout, config_heads) -> dict[str, AttentionHeads]:
    """Every module with 'column' children that is an attention module, its counts checked
    against the layout. ``config_heads``: (heads, kv heads, head_dim) from a transformers
    config, used where the module itself holds no count."""
    axis = layout.linear_output(layout.activation).hidden_axis
    parts = layout.mesh.size(axis)
    found: dict[str, AttentionHeads] = {}
    for name, module in model.named_modules():
        children = {f"{name}.{c}" if name else c: m for c, m in module.named_children()}
        columns = {n: m for n, m in children.items() if n in planned and planned[n][1] in COLUMN_STYLES}
        if not columns or not _looks_like_attention(module):
            continue
        heads = _int_attr(module, HEAD_ATTRS) or (config_heads[0] if config_heads else None)
        if heads is None:
            raise ValueError(f"{name} ({type(module).__name__}) looks like attention but holds no head count "
                             f"(one of {', '.join(HEAD_ATTRS)}); set one on the module so its heads can be split whole")
        kv = _int_attr(module, KV_ATTRS) or (config_heads[1] if config_heads else None) or heads
        head_dim = _int_attr(module, ("head_dim",)) or (config_heads[2] if config_heads else None)
        head_dim = head_dim or _out_features(next(iter(columns.values()))) // heads
        spec = AttentionHeads(name, module, heads, kv, head_dim, parts, axis)
        _check_counts(spec, layout)
        _check_attributes(spec)
        for n, m in columns.items():
            out = _out_features(m)
            if planned[n][1] == "head_fused_column" and out % (heads * head_dim) == 0:
                continue  # each head's parts sit together: a contiguous split keeps heads whole
            if planned[n][1] == "packed_column" and out % (heads * head_dim) == 0 and out > heads * head_dim:
                spec.packed[n] = out // (heads * head_dim)
                continue
            if out == heads * head_dim:
                continue
            if out == kv * head_dim:
                spec.kv_projections.add(n)
                continue
            raise ValueError(f"{n} has {out} output features, neither heads x head_dim = {heads} x {head_dim} "
                             f"nor kv heads x head_dim = {kv} x {head_dim}; shardzoo cannot tell which heads it "
                             f"carries. Plan a projection packing q|k|v as 'packed_column'")
        found[name] = spec
    return found


def _out_features(module: nn.Module) -> int:
    """Output features of an nn.Linear or a Conv1D (weight [in, out])."""
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[-1]


def head_parts_fit(heads: int, kv_heads: int, parts: int) -> bool:
    """Whether ``parts`` head parts keep every head whole: they divide the heads, and divide or
    are a multiple of the kv heads (then each kv head is copied to the parts that read it)."""
    return heads % parts == 0 and (kv_heads % parts == 0 or parts % kv_heads == 0)


def head_parts_that_work(heads: int, kv_heads: int) -> list[int]:
    """Every part count :func:`head_parts_fit` accepts, for an error's fix."""
    return [t for t in range(1, heads + 1) if head_parts_fit(heads, kv_heads, t)]


def _check_counts(spec: AttentionHeads, layout) -> None:
    p, n, kv = spec.parts, spec.heads, spec.kv_heads
    if head_parts_fit(n, kv, p):
        return
    tp_rule = f"tp={layout.mesh.tp_size} in tp_mode={layout.mode!r} splits the heads in {p} parts"
    works = head_parts_that_work(n, kv)
    raise ValueError(f"{spec.name}: {tp_rule}, which fits neither its {n} heads and {kv} kv heads (the parts must "
                     f"divide the heads, and divide or be a multiple of the kv heads); head parts that work: "
                     f"{works}")


def check_ulysses(attention: dict[str, AttentionHeads], sp: int) -> None:
    """Refuse, before anything moves, heads Ulysses cannot split: it hands each of the ``sp``
    ranks whole heads of this rank's q heads, so their count must be a multiple of sp."""
    for spec in attention.values():
        local = spec.heads // spec.parts
        if local % sp:
            up = -(-spec.heads // (spec.parts * sp)) * spec.parts * sp
            raise ValueError(f"{spec.name}: sp_mode='ulysses' splits each rank's {local} q heads ({spec.heads} heads "
                             f"over {spec.parts} head parts) over sp={sp}, which needs a multiple of {sp}; use "
                             f"sp_mode='ring' (no constraint on heads), or a head count that is a multiple of "
                             f"{spec.parts * sp} (e.g. {up})")


def _check_attributes(spec: AttentionHeads) -> None:
    """Refuse a head-named integer of the attention module that :func:`make_local` cannot set."""
    known = set(_local_values(spec)) | {"head_dim"}
    for attr, value in vars(spec.module).items():
        if (isinstance(value, int) and not isinstance(value, bool) and attr not in known and "head" in attr
                and value in (spec.heads, spec.kv_heads) and spec.parts > 1):
            raise ValueError(f"{spec.name}.{attr} = {value} looks like a head count, but shardzoo does not know what "
                             f"it counts, so cannot make it local; rename it to one of "
                             f"{', '.join(HEAD_ATTRS + KV_ATTRS)} or use tp=1")


def make_local(attention: dict[str, AttentionHeads]) -> None:
    """Set every head count and width an attention module (and its ``config``) holds to this
    rank's value (:func:`_check_attributes` refused the ones it cannot set)."""
    for spec in attention.values():
        local = _local_values(spec)
        for attr, value in list(vars(spec.module).items()):
            if not isinstance(value, int) or isinstance(value, bool) or attr == "head_dim":
                continue
            if attr in local:
                setattr(spec.module, attr, local[attr](value))
        config = getattr(spec.module, "config", None)
        if config is not None and hasattr(config, "num_attention_heads"):
            config = copy.copy(config)  # this module's own copy: other modules read the global counts
            for attr in ("num_attention_heads", "num_key_value_heads", "hidden_size"):
                value = getattr(config, attr, None)
                if isinstance(value, int) and attr in local:
                    setattr(config, attr, local[attr](value))
            spec.module.config = config


def _local_values(spec: AttentionHeads) -> dict:
    """attr -> fn(global value) -> local value, for the counts this attention module splits."""
    n, kv, d = spec.heads, spec.kv_heads, spec.head_dim
    hq, hkv = spec.local_heads, spec.local_kv_heads

    def when(global_value, local_value):
        return lambda v: local_value if v == global_value else v

    out = {a: when(n, hq) for a in HEAD_ATTRS}
    out.update({a: when(kv, hkv) for a in KV_ATTRS})
    out.update({a: when(n * d, hq * d) for a in WIDTH_ATTRS})
    out.update({a: when(n // kv, hq // hkv) for a in GROUP_ATTRS})
    return out
