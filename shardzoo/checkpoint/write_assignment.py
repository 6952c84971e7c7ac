"""The write assignment: which rank writes which piece, the same decision on every rank.

Each rank offers the valid boxes of the tensors the writer rule gives it; after one all-gather
every rank runs :func:`assign_writes` on the same list and gets the same answer: each distinct
piece goes to the lowest rank offering it, and every tensor's pieces must tile its global
shape exactly (no gap, no overlap) — a gap means some layer's ShardSpec lists too few
``partitioned_over`` axes, an overlap two different specs for the same region.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardzoo.checkpoint.tensors import intersect, volume


@dataclass(frozen=True)
class Offer:
    """A piece a rank can write: tensor ``name`` of ``section`` ("model" / "optimizer")."""

    section: str
    name: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def key(self) -> str:
        """The piece's name inside its shard file."""
        return f"{self.section}/{self.name}@{','.join(map(str, self.offsets))}"


@dataclass
class TensorAssignment:
    global_shape: tuple[int, ...]
    dtype: str
    pieces: dict[tuple, int] = field(default_factory=dict)  # (offsets, shape) -> writing rank


def assign_writes(offers_by_rank: list[list[Offer]]) -> tuple[dict[tuple[str, str], TensorAssignment],
                                                               list[str]]:
    """Owner of every piece and the problems found (empty when the pieces tile every tensor)."""
    assignments: dict[tuple[str, str], TensorAssignment] = {}
    problems: list[str] = []
    for rank, offers in enumerate(offers_by_rank):
        for o in offers:
            tensor = assignments.setdefault((o.section, o.name), TensorAssignment(o.global_shape, o.dtype))
            if (tensor.global_shape, tensor.dtype) != (o.global_shape, o.dtype):
                problems.append(
                    f"{o.section} tensor {o.name!r} is {o.dtype}{list(o.global_shape)} on rank {rank} but "
                    f"{tensor.dtype}{list(tensor.global_shape)} on a lower rank; every rank must build the same model"
                )
                continue
            tensor.pieces.setdefault((o.offsets, o.shape), rank)
    for (section, name), tensor in assignments.items():
        boxes = list(tensor.pieces)
        covered = sum(volume(s) for _, s in boxes)
        overlap = any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])
        if overlap or covered != volume(tensor.global_shape):
            what = "overlap" if overlap else f"cover {covered} of {volume(tensor.global_shape)} elements"
            problems.append(
                f"the pieces of {section} tensor {name!r} {list(tensor.global_shape)} offered by the writer ranks "
                f"{what}: "
                f"{sorted(boxes)}. Its layer's ShardSpecs do not tile the global tensor; partitioned_over must name "
                f"every mesh axis along which the pieces differ"
            )
    return assignments, problems


def pieces_of_rank(assignments: dict[tuple[str, str], TensorAssignment],
                   rank: int) -> set[tuple[str, str, tuple, tuple]]:
    """(section, name, offsets, shape) of every piece ``rank`` writes."""
    return {(sec, name, box[0], box[1])
            for (sec, name), p in assignments.items() for box, r in p.pieces.items() if r == rank}
