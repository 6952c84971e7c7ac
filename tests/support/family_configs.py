"""Config dicts of tiny models of each registered family, for the planner tests."""

from shardzoo.models.spec import spec_named


def config_of(family: str, layers: int, vocab: int, ffn: int, dropout: float) -> dict:
    """The config dict (the family's own field names) of a tiny ``family`` model: width 16, 4 heads,
    ``layers`` blocks, ``vocab`` tokens, an ``ffn``-wide MLP and ``dropout`` everywhere; the rest
    as the family's ``tiny_config`` (models/spec.py)."""
    return spec_named(family).tiny_config(layers, vocab, ffn, dropout, hidden=16, heads=4)
