"""The layout planner: which dp x pp x sp x tp layout, tp_mode, micro-batch count, activation
checkpointing and ZeRO stage to train a model with, from the formulas the layers obey
(docs/planner.md). ``shardzoo.plan(...)`` and ``shardzoo plan ...`` are the entry points."""
