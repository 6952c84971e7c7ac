"""One object per tp_mode: the layout a model is written against.

``layout_of(mesh)`` (cached per mesh) returns the mesh's :class:`TensorLayout`:
:class:`Layout1D`, :class:`Layout2D`, :class:`Layout2p5D` or :class:`Layout3D`. It knows the
mode's activation placement (``.activation``; 1D: features split over tp, no batch axes) and is the
one factory blocks and models use, so they never compare ``tp_mode`` themselves::

    layout = layout_of(mesh)
    ln = layout.norm(h)                                   # LayerNorm of the mode
    fc1 = layout.linear(h, 4 * h, style="column")         # first of a pair
    fc2 = layout.linear(4 * h, h, style="row")            # second: consumes fc1's output placement
    x = layout.shard_input(x_full)                        # [B, S, H] -> this rank's block
    y = layout.gather_output(fc2(act(fc1(ln(x)))))        # -> [B, S, H] on every rank

Every factory takes the sizes of its ``torch.nn`` twin or ``serial=`` an existing module
(whose weights every rank holds: parallel init equals serial init), plus ``placement=`` (the
input activation placement, default the canonical one) and ``device=``. Every kind exists in every
mode. The per-mode choices live here and in placements.py only (docs/design.md, "One object per
tp_mode").
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from shardzoo.comm import collectives as comm
from shardzoo.layers import placements
from shardzoo.layers.embedding_1d import VocabParallelEmbedding1D
from shardzoo.layers.embedding_2d import Embedding2D, VocabParallelEmbedding2D
from shardzoo.layers.embedding_2p5d import Embedding2p5D, PatchEmbedding2p5D, VocabParallelEmbedding2p5D
from shardzoo.layers.embedding_3d import Embedding3D, PatchEmbedding3D, VocabParallelEmbedding3D
from shardzoo.layers.head_1d import Classifier1D, LMHead1D
from shardzoo.layers.head_2d import Classifier2D, LMHead2D
from shardzoo.layers.head_2p5d import Classifier2p5D, LMHead2p5D
from shardzoo.layers.head_3d import Classifier3D, LMHead3D
from shardzoo.layers.placements import ActivationPlacement
from shardzoo.layers.linear_1d import ParallelLinear1D
from shardzoo.layers.linear_2d import ParallelLinear2D
from shardzoo.layers.linear_2p5d import ParallelLinear2p5D
from shardzoo.layers.linear_3d import ParallelLinear3D
from shardzoo.layers.norm_1d import LayerNorm1D, RMSNorm1D
from shardzoo.layers.norm_2d import LayerNorm2D, RMSNorm2D
from shardzoo.layers.norm_2p5d import LayerNorm2p5D, RMSNorm2p5D
from shardzoo.layers.norm_3d import LayerNorm3D, RMSNorm3D
from shardzoo.layers.patch_embedding_1d import PatchEmbedding1D
from shardzoo.layers.patch_embedding_2d import PatchEmbedding2D
from shardzoo.layers.rng_streams import dropout as stream_dropout

STYLES = ("column", "row")


def _linear(in_features, out_features, bias, dtype, serial) -> nn.Linear:
    return serial if serial is not None else nn.Linear(in_features, out_features, bias, dtype=dtype)


def _classifier_linear(in_features, num_classes, bias, dtype, serial, tie_to) -> nn.Linear:
    """The serial classifier; tied, its sizes and dtype default to the table's (its weight is
    then unused: the table replaces it, as in a serial tied model)."""
    if tie_to is not None and serial is None:
        in_features = tie_to.embedding_dim if in_features is None else in_features
        num_classes = tie_to.num_embeddings if num_classes is None else num_classes
        dtype = tie_to.weight.dtype if dtype is None else dtype
    return _linear(in_features, num_classes, bias, dtype, serial)


def _embedding(num_embeddings, embedding_dim, padding_idx, dtype, serial) -> nn.Embedding:
    return serial if serial is not None else nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype)


def _replicated(module: nn.Module, given: nn.Module | None, device) -> nn.Module:
    """A 1D replicated module: every tp rank holds all of it. A module the caller gave is
    copied, as ``from_serial`` copies, so the caller's module and the layer never share weights."""
    module = copy.deepcopy(module) if given is not None else module
    return module.to(device) if device is not None else module


class TensorLayout:
    """The blocks and activation placement of one tp_mode on one mesh (module docstring).

    Subclasses name their classes (``kinds``: kind -> class) and override what differs from
    the grid modes. Attributes: ``mesh``, ``mode``, ``activation`` (canonical
    :class:`~shardzoo.layers.placements.ActivationPlacement`), ``parallel_region`` (activations
    between blocks are split over tp, so dropout draws per-rank masks)."""

    mode = ""
    parallel_region = True
    kinds: dict[str, type] = {}

    def __init__(self, mesh):
        placements.check_mesh(mesh, self.mode, type(self).__name__)
        self.mesh = mesh
        self.activation = placements.canonical_placement(mesh)

    # -- placements -------------------------------------------------------------------------
    def linear_output(self, placement: ActivationPlacement | None = None) -> ActivationPlacement:
        """The placement a linear layer of this mode produces from ``placement`` (3D swaps two axes)."""
        return placement or self.activation

    def after(self, module: nn.Module, placement: ActivationPlacement | None = None) -> ActivationPlacement:
        """The activation placement ``module`` produces when it consumes ``placement`` (default canonical)."""
        return getattr(module, "output_placement", None) or (placement or self.activation)

    def _input(self, style: str, placement: ActivationPlacement | None) -> ActivationPlacement:
        if style not in STYLES:
            raise ValueError(f"{type(self).__name__}.linear style={style!r} is not one of {STYLES}")
        if placement is not None:
            return placement
        # a row layer is the second of a pair: it consumes the column layer's output placement
        return self.linear_output(self.activation) if style == "row" else self.activation

    # -- blocks -----------------------------------------------------------------------------
    def linear(self, in_features: int | None = None, out_features: int | None = None, bias: bool = True, *,
               style: str = "column", placement: ActivationPlacement | None = None, serial: nn.Linear | None = None,
               device=None, dtype=None) -> nn.Module:
        """The mode's linear layer; ``style`` "column" (first of a pair: consumes the block's
        placement; 1D splits out_features) or "row" (second: consumes the column layer's output;
        1D splits in_features). x [b, s, in_l] -> [b, s, out_l]."""
        serial = _linear(in_features, out_features, bias, dtype, serial)
        placement = self._input(style, placement)
        return self.kinds["linear"].from_serial(serial, self.mesh, device=device,
                                                **self._linear_args(style, placement))

    def _linear_args(self, style: str, placement: ActivationPlacement) -> dict:
        return {"placement": placement}

    def dense(self, in_features: int | None = None, out_features: int | None = None, bias: bool = True, *,
              serial: nn.Linear | None = None, device=None, dtype=None) -> nn.Module:
        """A projection that leaves the activation in its input placement (poolers, MLM transforms,
        OPT's project_in / out); a 3D linear swaps the placement, which :meth:`change_placement` undoes."""
        return self.linear(in_features, out_features, bias, serial=serial, device=device, dtype=dtype)

    def norm(self, normalized_shape: int | None = None, eps: float = 1e-5, elementwise_affine: bool = True,
             bias: bool = True, *, placement: ActivationPlacement | None = None, serial: nn.LayerNorm | None = None,
             device=None, dtype=None) -> nn.Module:
        """The mode's LayerNorm for activations in ``placement``: [b, s, H_l] -> same."""
        if serial is None:
            serial = nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias=bias, dtype=dtype)
        return self.kinds["norm"].from_serial(serial, self.mesh, device=device, placement=placement or self.activation)

    def rms_norm(self, normalized_shape: int | None = None, eps: float | None = None, elementwise_affine: bool = True,
                 *, placement: ActivationPlacement | None = None, serial: nn.RMSNorm | None = None, device=None,
                 dtype=None) -> nn.Module:
        """The mode's RMSNorm for activations in ``placement``: [b, s, H_l] -> same."""
        if serial is None:
            serial = nn.RMSNorm(normalized_shape, eps, elementwise_affine, dtype=dtype)
        return self.kinds["rms_norm"].from_serial(serial, self.mesh, device=device,
                                                  placement=placement or self.activation)

    def embedding(self, num_embeddings: int | None = None, embedding_dim: int | None = None,
                  padding_idx: int | None = None, *, placement: ActivationPlacement | None = None,
                  serial: nn.Embedding | None = None, device=None, dtype=None) -> nn.Module:
        """A small table (positions, token types) whose output follows the activation placement:
        ids [b, s] -> [b, s, H_l]."""
        serial = _embedding(num_embeddings, embedding_dim, padding_idx, dtype, serial)
        return self.kinds["embedding"].from_serial(serial, self.mesh, device=device,
                                                   placement=placement or self.activation)

    def vocab_embedding(self, num_embeddings: int | None = None, embedding_dim: int | None = None,
                        padding_idx: int | None = None, *, placement: ActivationPlacement | None = None,
                        serial: nn.Embedding | None = None, device=None, dtype=None) -> nn.Module:
        """A token table split along the vocabulary (and the hidden in grid modes):
        ids [b, s] -> [b, s, H_l]."""
        serial = _embedding(num_embeddings, embedding_dim, padding_idx, dtype, serial)
        return self.kinds["vocab_embedding"].from_serial(serial, self.mesh, device=device,
                                                         placement=placement or self.activation)

    def patch_embedding(self, image_size: int | None = None, patch_size: int | None = None,
                        in_channels: int | None = None, hidden_size: int | None = None, *,
                        placement: ActivationPlacement | None = None, serial: nn.Module | None = None, device=None,
                        dtype=None) -> nn.Module:
        """ViT patch embedding (cls token, projection, positions), from the sizes or a HF-style
        ``ViTEmbeddings``: pixels [b, C, img, img] -> [b, N+1, H_l]."""
        cls, placement = self.kinds["patch_embedding"], placement or self.activation
        if serial is None:
            return cls(image_size, patch_size, in_channels, hidden_size, mesh=self.mesh, dtype=dtype, device=device,
                       placement=placement)
        return cls.from_serial(serial, self.mesh, device=device, placement=placement, image_size=image_size)

    def lm_head(self, in_features: int | None = None, vocab_size: int | None = None, bias: bool = False, *,
                tie_to: nn.Module | None = None, placement: ActivationPlacement | None = None,
                serial: nn.Linear | None = None, device=None, dtype=None) -> nn.Module:
        """Vocabulary-parallel LM head sharing ``tie_to``'s table, or built from ``serial`` /
        the sizes: [b, s, H_l] -> logits [b, s, V_local]."""
        cls, placement = self.kinds["lm_head"], placement or self.activation
        if tie_to is not None:
            return cls(in_features, vocab_size, False, mesh=self.mesh, tie_to=tie_to, placement=placement)
        return cls.from_serial(_linear(in_features, vocab_size, bias, dtype, serial), self.mesh, device=device,
                               placement=placement)

    def classifier(self, in_features: int | None = None, num_classes: int | None = None, bias: bool = True, *,
                   tie_to: nn.Module | None = None, placement: ActivationPlacement | None = None,
                   serial: nn.Linear | None = None, device=None, dtype=None) -> nn.Module:
        """Few-class head with full logits: [b, ..., H_l] -> [b, ..., C]; with ``tie_to`` (an
        embedding or vocabulary embedding of this layout, table [C, H]) the weight is its table
        and the bias is ``serial``'s or drawn as nn.Linear's (sizes default to the table's)."""
        serial = _classifier_linear(in_features, num_classes, bias, dtype, serial, tie_to)
        if tie_to is not None:
            placement = placement or getattr(tie_to, "placement", None)
        return self.kinds["classifier"].from_serial(serial, self.mesh, device=device,
                                                    placement=placement or self.activation, tie_to=tie_to)

    # -- entering and leaving a placement (differentiable) ------------------------------------
    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """[B, ..., H] replicated -> this rank's block in the canonical placement."""
        return self.shard_hidden(x_full, self.activation)

    def gather_output(self, y_local: torch.Tensor) -> torch.Tensor:
        """This rank's canonical block -> [B, ..., H] on every rank."""
        return self.gather_hidden(y_local, self.activation)

    def shard_hidden(self, x_full: torch.Tensor, placement: ActivationPlacement | None = None) -> torch.Tensor:
        """[B, ..., H] replicated -> this rank's block in ``placement``."""
        return placements.shard_activation(x_full, self.mesh, placement or self.activation)

    def gather_hidden(self, y_local: torch.Tensor, placement: ActivationPlacement | None = None) -> torch.Tensor:
        """This rank's block in ``placement`` -> [B, ..., H] on every rank."""
        return placements.gather_activation(y_local, self.mesh, placement or self.activation)

    def shard_batch(self, t_full: torch.Tensor, placement: ActivationPlacement | None = None) -> torch.Tensor:
        """Split only dim 0 as ``placement`` does (ids, masks, targets, images): [B, ...] -> [b, ...]."""
        return placements.shard_batch(t_full, self.mesh, placement or self.activation)

    def gather_batch(self, t_local: torch.Tensor, placement: ActivationPlacement | None = None) -> torch.Tensor:
        """Inverse of :meth:`shard_batch`: [b, ...] -> [B, ...] on every rank."""
        return placements.gather_batch(t_local, self.mesh, placement or self.activation)

    def change_placement(self, x: torch.Tensor, src: ActivationPlacement, dst: ActivationPlacement) -> torch.Tensor:
        """Move an activation from placement ``src`` to ``dst``: gather to full and keep the
        ``dst`` block. Costs one all-gather of the activation, so models use it once at most."""
        if src == dst:
            return x
        return self.shard_hidden(self.gather_hidden(x, src), dst)

    def first_token(self, x: torch.Tensor) -> torch.Tensor:
        """Token 0 of every row, [b, s, H_l] -> [b, H_l] on every sp rank (it lives on sp rank
        0; the backward sums its gradient there): BERT's pooler, ViT's cls token."""
        return comm.broadcast(x[:, 0].contiguous(), self.mesh.sp_group, 0)

    # -- what blocks ask of the layout ----------------------------------------------------------
    def dropout(self, x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        """Dropout on an activation between blocks: per-rank masks where it is split over tp
        (``parallel_region``), the same mask on every tp rank where it is replicated (1D)."""
        return stream_dropout(x, p, mesh=self.mesh, parallel_region=self.parallel_region, training=training)

    def head_axis(self, placement: ActivationPlacement | None = None) -> tuple[str, int]:
        """(mesh axis splitting the attention heads, its size) for activations in ``placement``."""
        axis = (placement or self.activation).hidden_axis
        return axis, self.mesh.size(axis)

    def column_blocks(self) -> int:
        """How many contiguous blocks a column layer cuts its output features into (the grids:
        q along the output's hidden axis; 3D: q * q, the weight split further for memory)."""
        return self.mesh.q

    def head_rule(self) -> str:
        """How the heads are split, for error messages."""
        axis, parts = self.head_axis()
        return f"q={parts} (heads split over {axis} in tp_mode={self.mode!r})"

    def block_offsets(self, placement: ActivationPlacement, local_batch: int, local_heads: int) -> tuple[int, int]:
        """(global index of this rank's first batch row, of its first head) for activations
        [local_batch, ..., local_heads * head_dim] in ``placement``."""
        return placement.batch_index(self.mesh) * local_batch, self.mesh.rank(placement.hidden_axis) * local_heads

    def __repr__(self) -> str:
        return f"{type(self).__name__}(activation=({self.activation}), mesh={self.mesh!r})"


class Layout1D(TensorLayout):
    """Megatron 1D: column / row pairs over tp. Activations between blocks are replicated
    [b, s, H] (``shard_input`` / ``gather_output`` are identities); inside a pair the features
    are split over tp (``activation``). Small tables, the dense projections, the classifier and
    the patch embedding are replicated."""

    mode = "1d"
    parallel_region = False
    kinds = {"linear": ParallelLinear1D, "norm": LayerNorm1D, "rms_norm": RMSNorm1D, "embedding": nn.Embedding,
             "vocab_embedding": VocabParallelEmbedding1D, "patch_embedding": PatchEmbedding1D,
             "lm_head": LMHead1D, "classifier": Classifier1D}

    def _linear_args(self, style: str, placement: ActivationPlacement) -> dict:
        return {"style": style}

    def dense(self, in_features=None, out_features=None, bias=True, *, serial=None, device=None, dtype=None):
        return _replicated(_linear(in_features, out_features, bias, dtype, serial), serial, device)

    def norm(self, normalized_shape=None, eps=1e-5, elementwise_affine=True, bias=True, *, placement=None, serial=None,
             device=None, dtype=None):
        if serial is None:
            serial = nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias=bias, dtype=dtype)
        return LayerNorm1D.from_serial(serial, self.mesh, device=device)

    def rms_norm(self, normalized_shape=None, eps=None, elementwise_affine=True, *, placement=None, serial=None,
                 device=None, dtype=None):
        if serial is None:
            serial = nn.RMSNorm(normalized_shape, eps, elementwise_affine, dtype=dtype)
        return RMSNorm1D.from_serial(serial, self.mesh, device=device)

    def embedding(self, num_embeddings=None, embedding_dim=None, padding_idx=None, *, placement=None, serial=None,
                  device=None, dtype=None):
        return _replicated(_embedding(num_embeddings, embedding_dim, padding_idx, dtype, serial), serial, device)

    def vocab_embedding(self, num_embeddings=None, embedding_dim=None, padding_idx=None, *, placement=None,
                        serial=None, device=None, dtype=None):
        serial = _embedding(num_embeddings, embedding_dim, padding_idx, dtype, serial)
        return VocabParallelEmbedding1D.from_serial(serial, self.mesh, device=device)

    def lm_head(self, in_features=None, vocab_size=None, bias=False, *, tie_to=None, placement=None, serial=None,
                device=None, dtype=None):
        if tie_to is not None:
            return LMHead1D(in_features, vocab_size, False, mesh=self.mesh, tie_to=tie_to)
        return LMHead1D.from_serial(_linear(in_features, vocab_size, bias, dtype, serial), self.mesh,
                                            device=device)

    def classifier(self, in_features=None, num_classes=None, bias=True, *, tie_to=None, placement=None, serial=None,
                   device=None, dtype=None):
        serial = _classifier_linear(in_features, num_classes, bias, dtype, serial, tie_to)
        return Classifier1D.from_serial(serial, self.mesh, device=device, tie_to=tie_to)

    def shard_hidden(self, x_full, placement=None):
        return x_full  # 1D blocks take the replicated activation

    def gather_hidden(self, y_local, placement=None):
        return y_local

    def head_rule(self) -> str:
        return f"tp={self.mesh.tp_size}"

    def column_blocks(self) -> int:
        return self.mesh.tp_size


class Layout2D(TensorLayout):
    """Optimus (SUMMA) on a q x q grid: batch over tp_row, hidden over tp_col."""

    mode = "2d"
    kinds = {"linear": ParallelLinear2D, "norm": LayerNorm2D, "rms_norm": RMSNorm2D, "embedding": Embedding2D,
             "vocab_embedding": VocabParallelEmbedding2D, "patch_embedding": PatchEmbedding2D,
             "lm_head": LMHead2D, "classifier": Classifier2D}


class Layout2p5D(Layout2D):
    """Tesseract: the 2D grid on d depth slices; batch over tp_dep*tp_row, hidden over tp_col,
    parameters replicated over tp_dep."""

    mode = "2.5d"
    kinds = {"linear": ParallelLinear2p5D, "norm": LayerNorm2p5D, "rms_norm": RMSNorm2p5D, "embedding": Embedding2p5D,
             "vocab_embedding": VocabParallelEmbedding2p5D, "patch_embedding": PatchEmbedding2p5D,
             "lm_head": LMHead2p5D, "classifier": Classifier2p5D}


class Layout3D(TensorLayout):
    """The 3D cube: batch over tp_x*tp_y, hidden over tp_z; a linear layer maps (I, J | L) to
    (I, L | J), so a column / row pair ends where it started."""

    mode = "3d"
    kinds = {"linear": ParallelLinear3D, "norm": LayerNorm3D, "rms_norm": RMSNorm3D, "embedding": Embedding3D,
             "vocab_embedding": VocabParallelEmbedding3D, "patch_embedding": PatchEmbedding3D,
             "lm_head": LMHead3D, "classifier": Classifier3D}

    def linear_output(self, placement=None):
        return placements.swapped_3d(placement or self.activation)

    def column_blocks(self) -> int:
        return self.mesh.q * self.mesh.q


LAYOUTS = {cls.mode: cls for cls in (Layout1D, Layout2D, Layout2p5D, Layout3D)}
_ATTR = "_tensor_layout"


def layout_of(mesh) -> TensorLayout:
    """The :class:`TensorLayout` of ``mesh``'s tp_mode, made once per mesh."""
    mode = getattr(mesh, "tp_mode", None)
    if mode not in LAYOUTS:
        raise ValueError(f"layout_of needs a ParallelMesh (tp_mode one of {', '.join(LAYOUTS)}); got {mesh!r}")
    # kept on the mesh itself: the layout refers to its mesh, so a cache keyed weakly by the mesh
    # would keep every mesh (and its process groups' threads) alive; mesh <-> layout is a cycle
    # the collector frees with the mesh
    found = mesh.__dict__.get(_ATTR)
    if found is None:
        found = LAYOUTS[mode](mesh)
        mesh.__dict__[_ATTR] = found
    return found


for_mesh = layout_of
