"""Tiny transformers models (GPT-2, BERT, OPT, ViT) and the harness that compares shardzoo's
twins of them in every layout: outputs, losses and every gradient gathered to full size.

For the model tests; transformers is imported only inside the functions that build a model."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardzoo.layers.shard_spec import gather_full, get_shard_spec
from shardzoo.testing import assert_close, cached_mesh
from shardzoo.testing.dtypes import TINY_MODEL_TERMS, rms_of
from shardzoo.testing.meshes import with_world

# name -> (ParallelMesh kwargs, world)
LAYOUTS = {
    "serial": with_world(),
    "1d_tp2": with_world(tp=2),
    "1d_tp4": with_world(tp=4),
    "1d_tp2_sp2": with_world(tp=2, sp=2),
    "1d_tp2_dp2": with_world(tp=2, dp=2),
    "2d_tp4": with_world(tp=4, tp_mode="2d"),
    "2d_tp4_sp2": with_world(tp=4, tp_mode="2d", sp=2),
    "2.5d_tp8": with_world(tp=8, tp_mode="2.5d", tp_depth=2),
    "3d_tp8": with_world(tp=8, tp_mode="3d"),
}


def mesh_of(layout):
    """The (cached) ParallelMesh of ``layout``, a key of LAYOUTS."""
    return cached_mesh(**LAYOUTS[layout][0])


def dp_rows(t, mesh):
    """This dp replica's rows of a global batch (each replica feeds its own data)."""
    return t.chunk(mesh.dp_size, 0)[mesh.dp_rank]


def grads_vs_reference(model, mesh, expected: dict, what: str, scale: float = 1.0):
    """Average this rank's gradients over dp and sp (what DDP on group("dp", "sp") does), gather
    them to full size and compare with ``expected`` (shardzoo names; None: no gradient)."""
    group_size = mesh.size("dp", "sp")
    floor = rms_of(expected.values())  # a gradient that cancels to nothing still sums terms of this size
    for name, p in model.named_parameters():
        if expected[name] is None:  # outside the reference's loss (e.g. BERT's pooler under an MLM loss)
            assert p.grad is None, f"{what} grad {name}: the reference has none"
            continue
        g = p.grad
        if group_size > 1:
            g = g.clone()
            dist.all_reduce(g, group=mesh.group("dp", "sp"))
            g /= group_size
        assert_close(gather_full(g, get_shard_spec(model, name), mesh), expected[name], f"{what} grad {name}", scale,
                     terms=TINY_MODEL_TERMS, floor=floor)


def hf_gpt2(seed, **overrides):
    """A tiny transformers GPT2LMHeadModel (2 layers, width 64, vocab 101), weights from ``seed``, eval
    mode, no dropout; ``overrides``: GPT2Config fields."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0)
    cfg.update(overrides)
    return GPT2LMHeadModel(HFConfig(**cfg)).eval()


def converted(hf, convert, config):
    """HF state dict (or gradients) -> shardzoo names, full size."""
    out = {}
    for name, t in hf.items():
        for n, v in convert(name, t, config):
            out[n] = v
    return out


def shardzoo_twin(family: str, hf, mesh, **kwargs):
    """(model, config): the shardzoo ``family`` model with ``hf``'s config and weights (copied in
    memory through ``hf_to_shardzoo``), in eval mode; ``kwargs`` go to the constructor."""
    from shardzoo.models.spec import spec_named

    fam = spec_named(family)
    config = fam.config.from_json(hf.config.to_dict())
    model = fam.model(config, mesh=mesh, **kwargs).eval()
    model.load_full_state_dict(converted(hf.state_dict(), fam.hf_to_shardzoo, config))
    return model, config


def check_causal_lm(family: str, hf, layout, case, table: str, pad_id: int | None = None):
    """A causal LM (GPT-2, OPT) against transformers' ``hf``: logits, the global batch's loss and
    every gradient. ``table``: the tied embedding, whose gradient an untied ``lm_head`` copy gets;
    ``pad_id``: the first row starts with padding tokens (they get no gradient, as in HF)."""
    from shardzoo.models.spec import spec_named

    mesh = mesh_of(layout)
    model, config = shardzoo_twin(family, hf, mesh, sp_mode=case.get("sp_mode", "ring"))
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    ids_all = torch.randint(0, config.vocab_size, (case["batch"], case["seq"] + 1), generator=gen)
    if pad_id is not None:
        ids_all[0, :3] = pad_id
    ids, target = dp_rows(ids_all[:, :-1], mesh), dp_rows(ids_all[:, 1:], mesh)
    ref = hf(ids).logits
    logits = model(model.shard_input(ids))
    assert_close(model.gather_output(logits), ref, f"{layout} logits", terms=TINY_MODEL_TERMS)
    loss = model.loss(logits, model.shard_target(target))
    loss.backward()
    hf.zero_grad()
    # every rank's loss is the global batch's mean; its gradient is the dp x sp average of the ranks'
    full_loss = F.cross_entropy(hf(ids_all[:, :-1]).logits.flatten(0, 1), ids_all[:, 1:].flatten())
    full_loss.backward()
    assert_close(loss.detach(), full_loss.detach(), f"{layout} loss", terms=TINY_MODEL_TERMS)
    grads = converted({n: p.grad for n, p in hf.named_parameters()}, spec_named(family).hf_to_shardzoo, config)
    grads.setdefault("lm_head.weight", grads[table])
    grads_vs_reference(model, mesh, grads, layout)
    return float(loss)


def hf_bert(seed, **overrides):
    """A tiny transformers BertForPreTraining (2 layers, width 64, vocab 101), weights from ``seed``,
    eval mode, no dropout; ``overrides``: BertConfig fields."""
    from transformers import BertConfig as HFConfig
    from transformers import BertForPreTraining

    torch.manual_seed(seed)
    cfg = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=101,
               max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg.update(overrides)
    return BertForPreTraining(HFConfig(**cfg)).eval()


def hf_opt(seed, **overrides):
    """A tiny transformers OPTForCausalLM (2 layers, width 64, vocab 101), weights from ``seed``, eval
    mode, no dropout; ``overrides``: OPTConfig fields (OPT_350M: post-LN with project_in / out)."""
    from transformers import OPTConfig as HFConfig
    from transformers import OPTForCausalLM

    torch.manual_seed(seed)
    cfg = dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, vocab_size=101,
               max_position_embeddings=32, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    cfg.update(overrides)
    return OPTForCausalLM(HFConfig(**cfg)).eval()


# opt-350m style: post-LN, with project_in / project_out (word_embed_proj_dim below hidden_size)
OPT_350M = {"do_layer_norm_before": False, "word_embed_proj_dim": 32}


def hf_vit(seed, **overrides):
    """A tiny transformers ViTForImageClassification (2 layers, width 64; images [B, 3, 8, 8] in
    2x2 patches, 5 labels), weights from ``seed``, eval mode; ``overrides``: ViTConfig fields."""
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification

    torch.manual_seed(seed)
    cfg = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, image_size=8,
               patch_size=2, num_channels=3, num_labels=5)
    cfg.update(overrides)
    return ViTForImageClassification(HFConfig(**cfg)).eval()
