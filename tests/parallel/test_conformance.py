"""The conformance suite of ``shardzoo.parallelize`` / ``shardzoo.from_pretrained``: drawn
transformers models, dtypes, padded batches and meshes; each either equals the serial model or is
refused by size before any weight moves (shardzoo/testing/conformance.py, docs/parallelize.md,
"Conformance").

Small profile (the normal run): SHARDZOO_CONFORMANCE_EXAMPLES examples, 6 by default. Large
profile on demand: SHARDZOO_CONFORMANCE_EXAMPLES=200 python -m pytest tests/parallel/test_conformance.py
"""

import os
import tempfile

import pytest

pytest.importorskip("transformers", reason="transformers is in the test extra; these tests build its models")

from hypothesis import Phase, event, given, settings  # noqa: E402

from shardzoo.testing.conformance import cases, run_case  # noqa: E402

EXAMPLES = int(os.environ.get("SHARDZOO_CONFORMANCE_EXAMPLES", "6"))
# SHARDZOO_CONFORMANCE_SHRINK=0: report each failing example as drawn (a large run's failures
# then cost no shrinking round trips).
PHASES = [p for p in Phase if p != Phase.shrink or os.environ.get("SHARDZOO_CONFORMANCE_SHRINK", "1") != "0"]


@settings(derandomize=True, max_examples=EXAMPLES, deadline=None, phases=PHASES)
@given(case=cases())
def test_parallelized_model_equals_serial_or_is_refused_by_size(case):
    with tempfile.TemporaryDirectory() as tmpdir:
        outcome = run_case(case, tmpdir)
    event(outcome.split(":")[0])
