"""Mixture of experts split over ep by ``shardzoo.parallelize`` with the model's own plan
(``plan=None``, completed): a tiny random Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert) and
OLMoE, run by their own transformers code with ``output_router_logits=True``, equal the serial
model (fp32, padding included): loss, aux loss, router logits, logits, the gradient norm and
every weight after one SGD step, at ep 2 and 4 with dp, sp (ring and Ulysses: the aux loss over
the replica's whole sequences), 1d tp (Megatron sequence parallelism) and ZeRO 0, 1 and 3, each
rank holding 1/ep of the expert parameters; and the refusals.

The load-balancing loss is each dp replica's own (as any per-replica loss): the serial
reference is the cross entropy over the whole batch plus the router_aux_loss_coef times the
mean over the replicas of the aux loss of each replica's rows, whose gradient is what the
replicas' gradients averaged over dp give."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch

from shardzoo.testing import assert_close_conditioned, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_parallel import assert_step_equal, dp_rows, padded_batch
from support.moe_init import tiny_moe

WORLD, VOCAB = 4, 96


def _aux(model, router_logits, mask):
    import sys

    load_balancing_loss_func = sys.modules[type(model).__module__].load_balancing_loss_func  # the model's own
    return load_balancing_loss_func(router_logits, model.config.num_experts, model.config.num_experts_per_tok, mask)


def serial_step(model, batch, replicas: int):
    """One SGD step (lr 1) of the serial ``model`` on the whole batch, its loss the cross entropy
    over the batch plus coef * the mean over ``replicas`` row blocks of their aux loss. Returns
    the output with ``replica_aux`` [replicas] and ``replica_loss`` (the loss each replica sees)."""
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask)
    ce = model.loss_function(out.logits, labels, vocab_size=VOCAB)
    rows, seq = ids.shape
    per = rows // replicas
    coef = model.config.router_aux_loss_coef if model.config.output_router_logits else 0.0
    aux = torch.zeros(replicas) if not coef else torch.stack([_aux(model, tuple(r.view(rows, seq, -1)[i * per:(i + 1) * per].reshape(per * seq, -1)
                                         for r in out.router_logits), mask[i * per:(i + 1) * per])
                       for i in range(replicas)])
    (ce + coef * aux.mean()).backward()
    out.grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return SimpleNamespace(logits=out.logits.detach(), router_logits=[r.detach() for r in out.router_logits or ()],
                           replica_aux=aux.detach(), replica_loss=(ce + coef * aux).detach(), grad_norm=out.grad_norm)


def moe_against_serial(kind, mesh_kwargs, zero, sp_mode="ring", sequence_parallel=True):
    import shardzoo
    from shardzoo.models.training import global_grad_norm

    batch = padded_batch(rows=4, seq=16, vocab=VOCAB)
    serial = tiny_moe(kind)
    exact = copy.deepcopy(serial).double()
    parallel = copy.deepcopy(serial)
    mesh = cached_mesh(**mesh_kwargs)
    replicas = mesh.dp_size
    out_s, out_x = serial_step(serial, batch, replicas), serial_step(exact, batch, replicas)

    shardzoo.parallelize(parallel, mesh, sp_mode=sp_mode, sequence_parallel=sequence_parallel)  # the model's own plan
    experts = [m for m in parallel.modules() if type(m).__name__ == "ExpertsEP"]
    assert len(experts) == (2 if mesh.ep_size > 1 else 0) and all(m.num_experts == 4 // mesh.ep_size for m in experts)
    held = sum(p.numel() for n, p in parallel.named_parameters() if ".experts." in n)
    assert held * mesh.ep_size == sum(p.numel() for n, p in serial.named_parameters() if ".experts." in n)
    wrapped = shardzoo.data_parallel(parallel, mesh, zero=zero)
    rows = dp_rows(4, mesh)
    ids, mask, labels = (t[rows] for t in batch)
    out = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    norm = global_grad_norm(wrapped, mesh)
    optimizer = shardzoo.zero_optimizer(wrapped, torch.optim.SGD, lr=1.0)
    optimizer.step()
    if zero == 1:
        scheduled_step_moves_nothing(optimizer, list(wrapped.parameters()))
    r = mesh.dp_rank
    check_router_outputs(kind, out, out_s, out_x, r, rows, ids.shape[1])
    result = {"loss": out.loss.detach(), "logits": shardzoo.gather_logits(parallel, out.logits.detach()),
              "norm": norm, "state": shardzoo.full_state_dict(wrapped)}
    out_s.loss, out_x.loss = out_s.replica_loss[r], out_x.replica_loss[r]  # what this replica's loss is
    return assert_step_equal(f"{kind} {mesh_kwargs} {sp_mode} zero={zero}", result, (serial, out_s), (exact, out_x), rows,
                             batch[1].bool())


def scheduled_step_moves_nothing(optimizer, params):
    """The ZeRO 1 optimizer is one torch optimizer with one param group of every parameter: an
    LR scheduler setting lr 0 reaches both parts, so a second step leaves the weights alone."""
    assert isinstance(optimizer, torch.optim.Optimizer) and len(optimizer.param_groups) == 1
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in params}
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)
    optimizer.step()  # the gradients are still there


def check_router_outputs(kind, out, out_s, out_x, r, rows, seq):
    """This replica's aux loss and router logits equal the serial ones of its rows."""
    assert_close_conditioned(out.aux_loss.detach(), out_s.replica_aux[r], out_x.replica_aux[r], f"{kind} aux loss",
                             terms=TINY_MODEL_TERMS)
    for layer, (got, s, x) in enumerate(zip(out.router_logits, out_s.router_logits, out_x.router_logits)):
        mine = slice(rows.start * seq, rows.stop * seq)
        assert_close_conditioned(got.detach(), s[mine], x[mine], f"{kind} router logits of layer {layer}",
                                 terms=TINY_MODEL_TERMS)


# under sp the aux loss and router logits are the serial ones over the replica's whole sequences
CASES = [("mixtral", dict(dp=4, ep=2), 0, "ring"), ("mixtral", dict(dp=4, ep=4), 3, "ring"),
         ("qwen3_moe", dict(dp=4, ep=4), 0, "ring"), ("qwen3_moe", dict(dp=4, ep=2), 3, "ring"),
         ("mixtral", dict(dp=2, sp=2, ep=2), 0, "ring"), ("qwen3_moe", dict(dp=2, sp=2, ep=2), 3, "ulysses"),
         ("qwen3_moe", dict(dp=2, sp=2, ep=4), 3, "ring"),
         # ZeRO 1: the experts' optimizer state partitioned over edp, the rest over dp (x sp)
         ("mixtral", dict(dp=4, ep=2), 1, "ring"), ("qwen3_moe", dict(dp=2, sp=2, ep=2), 1, "ulysses"),
         # 1d tp: Megatron sequence parallelism splits the tokens over tp; router and experts on the chunks
         ("mixtral", dict(dp=2, tp=2, ep=2), 0, "ring"), ("mixtral", dict(dp=2, tp=2), 3, "ring"),
         ("qwen2_moe", dict(dp=4, ep=2), 0, "ring"),
         # the shared expert on the MoE block's flat chunk, its gate on the same tokens
         ("qwen2_moe", dict(dp=2, tp=2, ep=2), 1, "ring"),
         # OLMoE's q / k norms over every head: at tp 2 over the split width of q / k, statistics all-reduced
         ("olmoe", dict(dp=2, sp=2, ep=2), 3, "ring"), ("olmoe", dict(dp=2, tp=2, ep=2), 0, "ring"),
         # without Megatron sequence parallelism the MoE block runs the whole sequence on every tp rank
         ("qwen2_moe", dict(dp=2, tp=2, ep=2), 0, "ring-no-megatron-sp")]


@pytest.mark.parametrize("kind,mesh_kwargs,zero,sp_mode", CASES,
                         ids=[f"{k}-sp{m.get('sp', 1)}-{s}-tp{m.get('tp', 1)}-ep{m.get('ep', 1)}-zero{z}"
                              for k, m, z, s in CASES])
def test_moe_model_equals_serial(kind, mesh_kwargs, zero, sp_mode):
    sequence_parallel = not sp_mode.endswith("-no-megatron-sp")
    run_on_ranks(moe_against_serial, WORLD, kind, mesh_kwargs, zero, sp_mode.split("-")[0], sequence_parallel)


def test_moe_with_tp_and_sp_equals_serial():
    """dp 2 x sp 2 x tp 2 (8 ranks) at ep 2: the router logits gathered over the tp chunks, then sp."""
    run_on_ranks(moe_against_serial, 8, "mixtral", dict(dp=2, sp=2, tp=2, ep=2), 0, "ring", True)


def refusals(_):
    """Each refusal raises before any weight moves: the model is unchanged afterwards."""
    import shardzoo

    messages = {}
    from shardzoo.parallel.hf_model import default_plan

    cases = {"experts": ("mixtral", dict(dp=4, ep=4), dict(num_local_experts=6), None),
             # a layer directly in the MoE block would read its flat chunk of the tokens
             "dense_gate_on_chunks": ("qwen2_moe", dict(dp=2, tp=2, ep=2), None,
                                      {"model.layers.*.mlp.shared_expert_gate": "dense"})}
    for what, (kind, layout, config, entries) in cases.items():
        model = tiny_moe(kind)
        if config is not None:
            from transformers import MixtralConfig, MixtralForCausalLM

            model = MixtralForCausalLM(MixtralConfig(**{**model.config.to_dict(), **config}))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        mesh = cached_mesh(**layout)
        plan = None if entries is None else {**default_plan(model), **entries}
        with pytest.raises(ValueError) as err:
            shardzoo.parallelize(model, mesh, plan)
        messages[what] = str(err.value)
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), what
    from transformers import MixtralForSequenceClassification

    config = tiny_moe("mixtral").config
    config.num_labels, config.pad_token_id = 3, 0
    classifier = MixtralForSequenceClassification(config)  # no aux loss of a causal LM to make serial
    shardzoo.parallelize(classifier, cached_mesh(dp=2, sp=2, ep=2), {**default_plan(classifier), "score": "classifier"})
    with pytest.raises(ValueError) as err:
        classifier(input_ids=torch.ones(2, 8, dtype=torch.long))
    messages["classifier_router_logits"] = str(err.value)
    return messages


def test_refusals_name_the_value_the_rule_and_the_fix():
    m = run_on_ranks(refusals, WORLD, 0)[0]
    assert "ep=4 does not divide the 6 experts" in m["experts"] and "divides 6" in m["experts"]
    assert "output_router_logits=True with sp=2" in m["classifier_router_logits"]
    assert "MixtralForSequenceClassification" in m["classifier_router_logits"]
    gate = m["dense_gate_on_chunks"]
    assert "model.layers.0.mlp.shared_expert_gate" in gate and "'router'" in gate and "sequence_parallel=False" in gate


def grid_refused(_):
    import shardzoo

    messages = []
    for ep in (2, 1):  # whole experts (ep=1) read whole hidden vectors too
        with pytest.raises(ValueError) as err:
            shardzoo.parallelize(tiny_moe("mixtral"), cached_mesh(dp=2, tp=4, tp_mode="2d", ep=ep), plan=GRID_PLAN)
        messages.append(str(err.value))
    return messages


GRID_PLAN = {"embed_tokens": "vocab_embedding", "lm_head": "lm_head", "norm": "norm", "layers.*.input_layernorm": "norm",
             "layers.*.post_attention_layernorm": "norm", "layers.*.self_attn.q_proj": "column",
             "layers.*.self_attn.k_proj": "column", "layers.*.self_attn.v_proj": "column",
             "layers.*.self_attn.o_proj": "row", "layers.*.mlp.gate": "replicate", "layers.*.mlp.experts": "experts"}


def test_grid_layouts_with_ep_are_refused_by_name():
    for ep, message in zip((2, 1), run_on_ranks(grid_refused, 8, 0)[0]):
        assert f"ep={ep} with tp_mode='2d'" in message and "tp_mode='1d'" in message and "experts" in message
