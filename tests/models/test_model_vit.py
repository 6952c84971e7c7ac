"""ViT against transformers' ViTForImageClassification (same weights): logits, loss and every
gradient in every tp_mode, with sp=2 (17 tokens: padded and masked over sp) and dp=2."""

import pytest
import torch
import torch.nn.functional as F

from shardzoo.testing import assert_close, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_twins import LAYOUTS, converted, dp_rows, grads_vs_reference, hf_vit, mesh_of, shardzoo_twin


def check_vit(layout, case):
    from shardzoo.models.vit import hf_to_shardzoo

    mesh = mesh_of(layout)
    hf = hf_vit(case["seed"])
    model, config = shardzoo_twin("vit", hf, mesh, sp_mode=case.get("sp_mode", "ring"))
    assert config.num_labels == 5
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    pixels = torch.randn(case["batch"], 3, 8, 8, generator=gen)
    labels = torch.randint(0, 5, (case["batch"],), generator=gen)
    ref = hf(pixels).logits
    logits = model(model.shard_input(dp_rows(pixels, mesh)))  # each dp replica feeds its own rows
    assert_close(model.gather_output(logits), dp_rows(ref, mesh), f"{layout} logits", terms=TINY_MODEL_TERMS)
    loss = model.loss(logits, model.shard_target(dp_rows(labels, mesh)))
    ref_loss = F.cross_entropy(ref, labels)  # the global mean, on every rank
    assert_close(loss.detach(), ref_loss.detach(), f"{layout} loss", terms=TINY_MODEL_TERMS)
    loss.backward()
    ref_loss.backward()  # its gradient: the dp x sp average of the ranks' gradients
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, hf_to_shardzoo, config)
    grads_vs_reference(model, mesh, grads, layout)
    return True


CASES = [  # 1d tp2 runs inside 1d_tp2_sp2 / 1d_tp2_dp2, and 2d tp4 inside 2d_tp4_sp2
    ("serial", {}),
    ("1d_tp4", {}),
    ("1d_tp2_dp2", {}),
    ("1d_tp2_sp2", {}),
    ("2d_tp4_sp2", {"sp_mode": "ulysses"}),
    ("2.5d_tp8", {}),
    ("3d_tp8", {}),
]


@pytest.mark.parametrize("layout,changes", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_vit_matches_transformers(layout, changes):
    run_on_ranks(check_vit, LAYOUTS[layout][1], layout, {"seed": 0, "batch": 4, **changes})
