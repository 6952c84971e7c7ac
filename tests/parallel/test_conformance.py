"""The conformance suite of ``shardzoo.parallelize`` / ``shardzoo.from_pretrained``: drawn
transformers models, dtypes, padded batches and meshes; each either equals the serial model or is
refused by size before any weight moves (tests/support/conformance.py, docs/parallelize.md,
"Conformance").

Small profile (the normal run): SHARDZOO_CONFORMANCE_EXAMPLES drawn examples, 4 by default. Large
profile on demand: SHARDZOO_CONFORMANCE_EXAMPLES=200 python -m pytest tests/parallel/test_conformance.py
"""

import os
import tempfile

import pytest

pytest.importorskip("transformers", reason="transformers is in the test extra; these tests build its models")

from hypothesis import Phase, event, example, given, settings  # noqa: E402

from support.conformance import Case, cases, run_case  # noqa: E402

EXAMPLES = int(os.environ.get("SHARDZOO_CONFORMANCE_EXAMPLES", "4"))
# SHARDZOO_CONFORMANCE_SHRINK=0: report each failing example as drawn (a large run's failures
# then cost no shrinking round trips).
PHASES = [p for p in Phase if p != Phase.shrink or os.environ.get("SHARDZOO_CONFORMANCE_SHRINK", "1") != "0"]


# Examples the large profile found, kept: a Qwen2 whose one target's query sees one key (window 2,
# 2 real tokens), so the q bias's gradient is exactly 0 and the step leaves rounding noise there
# (compared at the scale of the model's gradients, reorder_bound's floor).
FOUND = [
    Case(arch="qwen2", config=(("head_dim", 4), ("hidden_size", 16), ("intermediate_size", 96), ("max_window_layers", 0),
                               ("num_attention_heads", 8), ("num_hidden_layers", 1), ("num_key_value_heads", 4),
                               ("sliding_window", 2), ("tie_word_embeddings", False), ("use_sliding_window", True),
                               ("vocab_size", 128)),
         dtype="fp32", rows=1, seq=4, side="right", pads=(2,), mesh=(("dp", 1), ("sp", 1), ("tp", 2), ("tp_mode", "1d")),
         sp_mode="ring", wrap=False, zero=2, seed=1),
    # A bf16 Llama under ring sp: its float32 loss is computed from bf16 logits, so bf16's roundoff
    # bounds it (assert_close_conditioned's computed_in), not float32's.
    Case(arch="llama", config=(("head_dim", 16), ("hidden_size", 48), ("intermediate_size", 16),
                               ("num_attention_heads", 2), ("num_hidden_layers", 2), ("num_key_value_heads", 1),
                               ("tie_word_embeddings", True), ("vocab_size", 96)),
         dtype="bf16", rows=2, seq=16, side="left", pads=(1, 0), mesh=(("dp", 1), ("sp", 2), ("tp", 1), ("tp_mode", "2.5d")),
         sp_mode="ring", wrap=True, zero=1, seed=457),
]


@settings(derandomize=True, max_examples=EXAMPLES, deadline=None, phases=PHASES)
@example(case=FOUND[0])
@example(case=FOUND[1])
@given(case=cases())
def test_parallelized_model_equals_serial_or_is_refused_by_size(case):
    with tempfile.TemporaryDirectory() as tmpdir:
        outcome = run_case(case, tmpdir)
    event(outcome.split(":")[0])


def test_a_refusal_must_name_a_size_and_a_fix():
    """The refusal check fails a message without a size of the case or without a fix."""
    from support.conformance import Case, check_refusal

    case = Case(arch="llama", config=(("hidden_size", 30), ("num_attention_heads", 3)), dtype="fp32", rows=1, seq=8,
                side="right", pads=(0,), mesh=(("tp", 4), ("tp_mode", "2d")), sp_mode="ring", wrap=False, zero=0,
                seed=0)
    check_refusal("model.layers.0.mlp.gate_proj (column) has in_features=30, the hidden size, which the 2d layout "
                  "splits into 2 blocks; use a hidden size that is a multiple of 2 (e.g. 32)", case)
    for message in ("the hidden size does not fit the layout", "hidden size 31 does not split; use another one",
                    "in_features=30 does not split over 2 blocks"):
        with pytest.raises(AssertionError, match="must name a size"):
            check_refusal(message, case)
