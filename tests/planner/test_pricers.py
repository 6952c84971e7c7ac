"""The plan styles (parallel/styles) and the planner's pricers (planner/walk_pieces.py) are two
tables keyed by the same names: a style the planner cannot price, or a pricer of no style, fails
here rather than at the first plan that uses it."""

from shardzoo.parallel.styles import STYLES
from shardzoo.planner.walk_pieces import PRICERS

MODES = {"1d", "2d", "2.5d", "3d"}


def test_every_style_has_a_pricer_and_every_pricer_a_style():
    assert not set(STYLES) - set(PRICERS), f"styles without a pricer: {sorted(set(STYLES) - set(PRICERS))}"
    assert not set(PRICERS) - set(STYLES), f"pricers of no style: {sorted(set(PRICERS) - set(STYLES))}"


def test_each_style_is_registered_under_its_own_name_and_builds_in_every_mode():
    for name, style in STYLES.items():
        assert style.name == name, f"STYLES[{name!r}] is {style!r}"
        assert not style.layers or set(style.layers) == MODES, f"{name}: layers for {sorted(style.layers)}"
