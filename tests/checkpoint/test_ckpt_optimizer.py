"""AdamW state is saved and resharded with the parameters: resuming gives the same next-step loss."""

import math

from support.checkpoint_stack import resume, run, train_and_save


def test_optimizer_resume_same_and_other_layouts(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    expected = run("1d_tp2", train_and_save, ckpt)
    assert len(set(expected)) == 1
    same = run("1d_tp2", resume, ckpt)
    assert same == expected  # same layout: bit-identical continuation
    for layout in ("1d_tp4", "serial"):  # resharded: equal up to the order of the tp sums (fp64)
        got = run(layout, resume, ckpt)
        assert all(math.isclose(g, expected[0], rel_tol=1e-12) for g in got), (layout, got, expected)
