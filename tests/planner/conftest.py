"""bench/ on sys.path: the checks of the planner against real runs use bench/_measure.py (the
worker pools spawn later and inherit the path)."""

import pathlib
import sys

BENCH = str(pathlib.Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
