"""Bytes one rank sends for one block's forward + backward in each tp_mode, and the parameter
bytes it holds: the closed forms of docs/tp_modes.md, read off the cost objects of
:mod:`shardzoo.planner.block_costs` (the one place that knows the per-layout formulas).

These are what ``bench/tp_modes.py`` prints next to the bytes it measures and what the layer
tests compare ``shardzoo.comm.count`` with; both must agree exactly. Arguments: ``q`` = the
grid side (1D: the tp size), ``d`` = the 2.5D depth, ``e`` = bytes per element (activations and
parameters alike), ``rows`` = this rank's activation rows (tokens).
"""

from __future__ import annotations

from fractions import Fraction

from shardzoo.comm.tp_grids import tp_grid
from shardzoo.planner import block_costs
from shardzoo.planner.block_costs import Piece
from shardzoo.planner.comm import call_bytes


def sent_bytes(piece: Piece) -> Fraction:
    """Bytes one rank sends for every call of ``piece`` (forward and backward)."""
    return sum((call_bytes(c) for c in piece.calls), Fraction(0))


def costs_of(mode: str, q: int, d: int = 1, e: int = 4):
    """The block_costs object of ``mode`` on a grid of side ``q`` (depth ``d``)."""
    return block_costs.costs_of(mode, tp_grid(mode).size(q, d), d, e)


def _mlp_pieces(mode, rows, hidden, ffn, q, d, e) -> list[Piece]:
    costs = costs_of(mode, q, d, e)
    placement = costs.canonical
    return [costs.layer_norm(hidden, rows, e, placement),
            costs.linear(hidden, ffn, rows, e, placement, style="column"),
            costs.linear(ffn, hidden, rows, e, costs.after(placement), style="row")]


def mlp_block_bytes(mode: str, batch: int, seq: int, hidden: int, ffn: int, q: int, d: int = 1, e: int = 4) -> Fraction:
    """The MLP block (LayerNorm, fc1 hidden -> ffn, fc2 ffn -> hidden, biases on) on a full
    batch of ``batch`` x ``seq`` tokens: bytes one rank sends, forward + backward."""
    costs = costs_of(mode, q, d, e)
    parts = costs.batch_parts(costs.canonical)
    return sum((sent_bytes(p) for p in _mlp_pieces(mode, batch // parts * seq, hidden, ffn, q, d, e)), Fraction(0))


def mlp_param_bytes(mode: str, hidden: int, ffn: int, q: int, d: int = 1, e: int = 4) -> int:
    """Parameter bytes one rank holds for the MLP block (LayerNorm weight + bias, two linears
    with bias)."""
    return sum(p.params for p in _mlp_pieces(mode, 1, hidden, ffn, q, d, e)) * e


def embedding_bytes(mode: str, vocab: int, hidden: int, q: int, d: int = 1, e: int = 4) -> Fraction:
    """Embedding{2D,2p5D,3D}: hidden chunks gathered over the parameter axes, their gradient
    reduce-scattered; 2.5D sums the table gradient over depth."""
    costs = costs_of(mode, q, d, e)
    return sent_bytes(costs.hidden_embedding(vocab, hidden, 1, e, costs.canonical))


def vocab_embedding_bytes(mode: str, vocab: int, hidden: int, rows: int, q: int, d: int = 1, e: int = 4) -> Fraction:
    """VocabParallelEmbedding*: ids all-gathered, partial embeddings reduce-scattered over the
    vocabulary axis; 3D gathers the table over its second batch axis, 2.5D sums it over depth."""
    costs = costs_of(mode, q, d, e)
    return sent_bytes(costs.vocab_embedding(vocab, hidden, rows, e, costs.canonical))


def classifier_bytes(mode: str, classes: int, hidden: int, rows: int, q: int, d: int = 1, e: int = 4) -> Fraction:
    """Classifier* (bias on): weight gathered like a table, logits all-reduced over the hidden
    axis, bias gradient summed over the batch axes."""
    costs = costs_of(mode, q, d, e)
    return sent_bytes(costs.classifier(classes, hidden, rows, e, costs.canonical))


def lm_head_bytes(mode: str, vocab: int, hidden: int, rows: int, q: int, d: int = 1, e: int = 4,
                  bias: bool = False) -> Fraction:
    """LMHead*: the SUMMA products (2D / 2.5D) or the 3D linear product on the padded vocabulary,
    plus the bias gradient over the batch axes when ``bias``."""
    costs = costs_of(mode, q, d, e)
    piece = costs.lm_head(vocab, hidden, rows, e, costs.canonical)
    return sent_bytes(piece) + (sent_bytes(costs.vocab_bias(vocab, rows, e, costs.canonical)) if bias else 0)


def patch_embedding_bytes(mode: str, image: int, patch: int, channels: int, hidden: int, q: int, d: int = 1,
                          e: int = 4) -> Fraction:
    """PatchEmbedding*: conv weight and bias, cls token and positions gathered like a table
    (pixels need no gradient)."""
    costs = costs_of(mode, q, d, e)
    return sent_bytes(costs.patch_embedding(image, patch, channels, hidden, 1, e, costs.canonical))
