"""``from_pretrained``: Hugging Face safetensors directories (written here by transformers'
``save_pretrained``) loaded into every family on every tp mode and as pipeline stages, compared
with transformers' outputs; vocabulary padding, sharded indexes, base-model and old BERT key
names, fp16 files, per-rank slice reads, and errors naming the offending tensors on every rank."""

import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from shardzoo.models.spec import family_names
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_twins import LAYOUTS

VOCAB = 101  # not divisible by 2, 4 or 8: every tp layout pads the vocabulary
BATCH, SEQ = 4, 8
LAYOUTS_OF_WORLD = {1: ["serial"], 2: ["1d_tp2"], 4: ["2d_tp4"], 8: ["2.5d_tp8", "3d_tp8"]}
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)


# -- checkpoints, written once per module by transformers ---------------------------------------
def _save(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return str(path)


def _rewrite(src: str, dst, edit):
    """Copy Hugging Face dir ``src`` to ``dst`` with its model.safetensors passed through ``edit``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})
    return str(dst)


def _without(key):
    def edit(state):
        del state[key]
        return state
    return edit


def _with(key, tensor):
    def edit(state):
        state[key] = tensor
        return state
    return edit


def _legacy_bert_names(state):
    """LayerNorm ``weight`` / ``bias`` -> ``gamma`` / ``beta``, as in old BERT checkpoints."""
    out = {}
    for k, v in state.items():
        if ".LayerNorm." in k:
            k = k.replace(".LayerNorm.weight", ".LayerNorm.gamma").replace(".LayerNorm.bias", ".LayerNorm.beta")
        out[k] = v
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Directories (by name) and transformers' reference outputs for fixed inputs."""
    import transformers as tf

    root = tmp_path_factory.mktemp("hf")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    types = torch.randint(0, 2, (BATCH, SEQ), generator=gen)
    mask = torch.arange(SEQ)[None] < torch.tensor([SEQ, 5, 3, SEQ])[:, None]
    pixels = torch.randn(BATCH, 3, 8, 8, generator=gen)
    dirs, refs = {}, {}

    torch.manual_seed(1)
    gpt2_cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(**gpt2_cfg)).eval()
    dirs["gpt2"] = _save(gpt2, root / "gpt2")
    refs["gpt2"] = gpt2(ids).logits.detach()
    dirs["gpt2_sharded"] = _save(gpt2, root / "gpt2_sharded", max_shard_size="100KB")
    # the bare GPT2Model, with the causal-mask buffers older checkpoints carry
    dirs["gpt2_base"] = _rewrite(_save(gpt2.transformer, root / "gpt2_base_plain"), root / "gpt2_base",
                                 _with("h.0.attn.bias", torch.tril(torch.ones(1, 1, 32, 32))))
    dirs["gpt2_fp16"] = _rewrite(dirs["gpt2"], root / "gpt2_fp16",
                                 lambda s: {k: v.half() for k, v in s.items()})
    torch.manual_seed(2)
    untied = tf.GPT2Model(tf.GPT2Config(**gpt2_cfg, tie_word_embeddings=False)).eval()
    dirs["gpt2_untied_base"] = _save(untied, root / "gpt2_untied_base")

    torch.manual_seed(3)
    bert_cfg = tf.BertConfig(**SMALL, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=32,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    bert = tf.BertForMaskedLM(bert_cfg).eval()
    dirs["bert"] = _save(bert, root / "bert")
    refs["bert"] = bert(ids, attention_mask=mask.long(), token_type_ids=types).logits.detach()
    dirs["bert_legacy"] = _rewrite(dirs["bert"], root / "bert_legacy", _legacy_bert_names)
    torch.manual_seed(4)
    bert_base = tf.BertModel(bert_cfg).eval()
    dirs["bert_base"] = _save(bert_base, root / "bert_base")
    out = bert_base(ids, attention_mask=mask.long(), token_type_ids=types)
    refs["bert_base"] = out.last_hidden_state.detach()
    refs["bert_base_pooled"] = out.pooler_output.detach()

    torch.manual_seed(5)
    vit = tf.ViTForImageClassification(tf.ViTConfig(**SMALL, intermediate_size=128, image_size=8, patch_size=2,
                                                    num_channels=3, num_labels=5)).eval()
    dirs["vit"] = _save(vit, root / "vit")
    refs["vit"] = vit(pixels).logits.detach()

    opt_cfg = dict(**SMALL, ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=32, word_embed_proj_dim=64,
                   dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(6)
    opt = tf.OPTForCausalLM(tf.OPTConfig(**opt_cfg)).eval()
    dirs["opt"] = _save(opt, root / "opt")
    refs["opt"] = opt(ids).logits.detach()
    torch.manual_seed(7)  # opt-350m style: project_in / project_out, post-LN
    opt350 = tf.OPTForCausalLM(tf.OPTConfig(**{**opt_cfg, "word_embed_proj_dim": 32,
                                               "do_layer_norm_before": False})).eval()
    dirs["opt350"] = _save(opt350, root / "opt350")
    refs["opt350"] = opt350(ids).logits.detach()

    # broken checkpoints
    dirs["missing"] = _rewrite(dirs["gpt2"], root / "missing", _without("transformer.h.1.attn.c_attn.weight"))
    dirs["extra"] = _rewrite(dirs["gpt2"], root / "extra", _with("transformer.h.2.ln_1.weight", torch.ones(64)))
    dirs["misshaped"] = _rewrite(dirs["gpt2"], root / "misshaped", _with("transformer.wpe.weight", torch.zeros(16, 64)))
    dirs["ln_f_shape"] = _rewrite(dirs["gpt2"], root / "ln_f_shape", _with("transformer.ln_f.weight", torch.ones(48)))
    dirs["ln_f_missing"] = _rewrite(dirs["gpt2"], root / "ln_f_missing", _without("transformer.ln_f.bias"))
    for family in ("gpt2", "bert"):  # config.json alone
        os.makedirs(root / f"{family}_no_weights")
        shutil.copy(os.path.join(dirs[family], "config.json"), root / f"{family}_no_weights")
        dirs[f"{family}_no_weights"] = str(root / f"{family}_no_weights")
    shutil.copytree(dirs["gpt2_sharded"], root / "lost_shard")
    with open(root / "lost_shard" / "model.safetensors.index.json") as f:
        lost = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(root / "lost_shard" / lost)
    dirs["lost_shard"], dirs["lost_shard_file"] = str(root / "lost_shard"), lost

    inputs = dict(ids=ids, types=types, mask=mask, pixels=pixels)
    return dict(dirs=dirs, refs=refs, inputs=inputs)


# -- helpers run on the ranks -------------------------------------------------------------------
def _forward(model, family, inputs):
    """The full output (logits, or BERT's final hidden states without the MLM head) on every rank."""
    if family == "vit":
        return model.gather_output(model(model.shard_input(inputs["pixels"])))
    if family == "bert":
        out = model(model.shard_input(inputs["ids"]), model.shard_mask(inputs["mask"]),
                    model.shard_input(inputs["types"]))
        return model.gather_output(out)
    return model.gather_output(model(model.shard_input(inputs["ids"])))


def _padding(model) -> int:
    """Number of padding elements on this rank; asserts they are all zero."""
    from shardzoo.checkpoint.tensors import model_tensors

    count = 0
    for lt in model_tensors(model)[0]:
        if lt.spec is None:
            continue
        pad = torch.ones(lt.tensor.shape, dtype=torch.bool)
        pad[lt.spec.valid_local()] = False
        count += int(pad.sum())
        assert not lt.tensor.detach()[pad].any(), f"padding of {lt.name} is not zero"
    return count


def _expected(hf_dir, family, config):
    """The checkpoint under shardzoo names (full size, float32), read whole with safetensors."""
    from safetensors.torch import load_file

    from shardzoo.models.spec import spec_named

    fam = spec_named(family)
    out = {}
    for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        for name, t in fam.hf_to_shardzoo(fam.canonical(k), v.float(), config):
            out[name] = t
    return out


def _gathered(model):
    from shardzoo.layers.shard_spec import gather_full, get_shard_spec

    return {n: gather_full(p, get_shard_spec(model, n), model.mesh) for n, p in model.named_parameters()}


def _outcome(fn):
    """(exception type name, message) of ``fn()``, or None when it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        return type(e).__name__, str(e)
    return None


# -- 1. every family on every layout, against transformers ----------------------------------------
VARIANTS = {"gpt2": ["gpt2"], "bert": ["bert", "bert_base"], "vit": ["vit"], "opt": ["opt", "opt350"]}
# BertForMaskedLM files have no pooler, so the model is built without one; with pooler=True it
# is left as initialised and reported missing, not an error
POOLER = ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]


def check_family(family, world, dirs, refs, inputs):
    from shardzoo.models.spec import spec_named

    cls = spec_named(family).model
    padding = 0
    for layout in LAYOUTS_OF_WORLD[world]:
        mesh = cached_mesh(**LAYOUTS[layout][0])
        for variant in VARIANTS[family]:
            model = cls.from_pretrained(dirs[variant], mesh=mesh).eval()
            assert model.load_result == ([], []), f"{layout} {variant}: {model.load_result}"
            if variant == "bert":
                assert not hasattr(model.bert, "pooler")
            with torch.no_grad():
                out = _forward(model, family, inputs)
                assert_close(out, refs[variant], f"{layout} {variant} output", terms=TINY_MODEL_TERMS)
                if variant == "bert_base":  # BertModel file -> the bare encoder, pooler included
                    assert model.head_name is None and not hasattr(model, "cls")
                    hidden = model(model.shard_input(inputs["ids"]), model.shard_mask(inputs["mask"]),
                                   model.shard_input(inputs["types"]))
                    assert_close(model.gather_pooled(model.pool(hidden)), refs["bert_base_pooled"],
                                 f"{layout} {variant} pooled", terms=TINY_MODEL_TERMS)
            padding += _padding(model)
    return padding


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("family", family_names())
def test_family_matches_transformers(ckpt, family, world):
    """Outputs equal transformers' in every layout of ``world``; vocabulary padding rows are zero
    (and exist wherever the vocabulary is split: 101 rows over 2, 4, 8 ranks)."""
    padding = run_on_ranks(check_family, world, family, world, ckpt["dirs"], ckpt["refs"], ckpt["inputs"])
    if world > 1 and family != "vit":  # ViT has no vocabulary
        assert sum(padding) > 0


# -- pipeline stages -----------------------------------------------------------------------------
def check_pipeline_stages(hf_dir, ref, inputs):
    from shardzoo.models import GPT2

    mesh = cached_mesh(pp=2, tp=2)
    model = GPT2.from_pretrained(hf_dir, mesh=mesh, stage=(mesh.pp_rank, 2)).eval()
    assert model.load_result == ([], [])
    expected = _expected(hf_dir, "gpt2", model.config)
    if model.is_last:  # the untied copy of the table on the last stage reads the table
        assert "transformer.wte.weight" not in dict(model.named_parameters())
        expected["lm_head.weight"] = expected["transformer.wte.weight"]
    for name, full in _gathered(model).items():
        assert torch.equal(full, expected[name]), f"stage {mesh.pp_rank} {name}"
    first, last = mesh.ranks("pp")
    with torch.no_grad():
        if model.is_first:
            dist.send(model(model.shard_input(inputs["ids"])).contiguous(), last)
            return None
        hidden = torch.empty(BATCH, SEQ, model.config.n_embd)
        dist.recv(hidden, first)
        logits = model.gather_output(model(hidden))
    assert_close(logits, ref, "last stage logits", terms=TINY_MODEL_TERMS)
    return sorted(n for n, _ in model.named_parameters())


def test_pipeline_stages_load_their_own_weights(ckpt):
    """GPT-2 as 2 stages (pp=2, tp=2): every stage's parameters equal the checkpoint's, the last
    stage's lm_head copy included, and the stages run together give transformers' logits."""
    out = run_on_ranks(check_pipeline_stages, 4, ckpt["dirs"]["gpt2"], ckpt["refs"]["gpt2"], ckpt["inputs"])
    last = [names for names in out if names is not None]
    assert len(last) == 2 and "lm_head.weight" in last[0]


# -- 2-4, 7: sharded index, base-model and old names, fp16 ---------------------------------------
def check_variants(dirs, refs, inputs):
    from shardzoo.models import BERT, GPT2

    mesh = cached_mesh(tp=2)
    single = GPT2.from_pretrained(dirs["gpt2"], mesh=mesh).eval()
    # sharded model.safetensors.index.json: the same tensors
    sharded = GPT2.from_pretrained(dirs["gpt2_sharded"], mesh=mesh).eval()
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), f"sharded index: {name}"
    with torch.no_grad():
        assert_close(_forward(sharded, "gpt2", inputs), refs["gpt2"], "sharded index logits", terms=TINY_MODEL_TERMS)

    # GPT2Model file (no "transformer." prefix, causal-mask buffers): complete for a tied model
    base = GPT2.from_pretrained(dirs["gpt2_base"], mesh=mesh).eval()
    assert base.load_result == ([], [])
    with torch.no_grad():
        assert_close(_forward(base, "gpt2", inputs), refs["gpt2"], "GPT2Model file logits", terms=TINY_MODEL_TERMS)
    # an untied GPT2Model file lacks only the LM head
    untied = GPT2.from_pretrained(dirs["gpt2_untied_base"], mesh=mesh, strict=False)
    assert untied.load_result == (["lm_head.weight"], [])
    expected = _expected(dirs["gpt2_untied_base"], "gpt2", untied.config)
    for name, full in _gathered(untied).items():
        if name != "lm_head.weight":
            assert torch.equal(full, expected[name]), name
    strict = _outcome(lambda: GPT2.from_pretrained(dirs["gpt2_untied_base"], mesh=mesh))

    # old BERT names (LayerNorm gamma / beta)
    legacy = BERT.from_pretrained(dirs["bert_legacy"], mesh=mesh).eval()
    normal = BERT.from_pretrained(dirs["bert"], mesh=mesh).eval()
    assert legacy.load_result == ([], [])
    for (name, a), (_, b) in zip(legacy.state_dict().items(), normal.state_dict().items()):
        assert torch.equal(a, b), f"gamma/beta names: {name}"
    assert BERT.from_pretrained(dirs["bert"], mesh=mesh, pooler=True).load_result == (POOLER, [])
    with torch.no_grad():
        assert_close(_forward(legacy, "bert", inputs), refs["bert"], "gamma/beta logits", terms=TINY_MODEL_TERMS)

    # fp16 file into the fp32 model: the fp16 values, upcast
    half = GPT2.from_pretrained(dirs["gpt2_fp16"], mesh=mesh)
    expected = _expected(dirs["gpt2_fp16"], "gpt2", half.config)
    expected["lm_head.weight"] = expected["transformer.wte.weight"]
    for name, p in half.named_parameters():
        assert p.dtype == torch.float32, name
    gathered = _gathered(half)
    for name, full in gathered.items():
        assert torch.equal(full, expected[name]), f"fp16 file: {name}"
    full_fp32 = _gathered(single)
    assert any(not torch.equal(gathered[n], full_fp32[n]) for n in gathered)  # the file really was rounded
    return strict


def test_checkpoint_variants(ckpt):
    """On tp=2: a sharded index loads the same tensors; a GPT2Model file (no prefix, mask
    buffers) loads completely into the tied GPT2, an untied one reports only lm_head.weight
    missing (strict raises naming it); old BERT gamma / beta names load identically; a BERT
    asked for a pooler its file lacks reports it missing; an fp16 file gives the fp16 values
    in fp32 parameters."""
    d = ckpt["dirs"]
    assert os.path.isfile(os.path.join(d["gpt2_sharded"], "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(d["gpt2_sharded"], "model.safetensors"))
    assert len([f for f in os.listdir(d["gpt2_sharded"]) if f.endswith(".safetensors")]) >= 2
    strict = run_on_ranks(check_variants, 2, d, ckpt["refs"], ckpt["inputs"])
    for kind, message in strict:
        assert kind == "CheckpointError" and "lm_head.weight" in message and "missing" in message, message


def save_loaded_bert(hf_dir, out):
    from shardzoo import checkpoint
    from shardzoo.models import BERT

    model = BERT.from_pretrained(hf_dir, mesh=cached_mesh(tp=2))
    checkpoint.save(model, out, config=model.config)
    return sorted(n for n, _ in model.named_parameters())


def test_bert_export_holds_what_was_loaded(ckpt, tmp_path):
    """A BertForMaskedLM file (no pooler) loaded on tp=2, saved and exported: transformers'
    BertForMaskedLM loads the export with no missing or unexpected keys, and every weight equal."""
    from transformers import BertForMaskedLM

    from shardzoo import checkpoint

    names = run_on_ranks(save_loaded_bert, 2, ckpt["dirs"]["bert"], str(tmp_path / "ckpt"))[0]
    assert not [n for n in names if n.startswith("bert.pooler.")]
    checkpoint.export_plain(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    loaded, info = BertForMaskedLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = BertForMaskedLM.from_pretrained(ckpt["dirs"]["bert"]).state_dict()
    assert [k for k, v in loaded.state_dict().items() if not torch.equal(v, original[k])] == []


# -- 6. each rank reads only its slices ----------------------------------------------------------
class _CountingSlice:
    """A safetensors slice that records how many elements each indexing takes from the file."""

    def __init__(self, data, taken):
        self._data, self._taken = data, taken

    def __getitem__(self, index):
        out = self._data[index]
        self._taken.append(out.numel())
        return out

    def __getattr__(self, name):
        return getattr(self._data, name)


class _CountingOpen:
    """``safe_open`` whose ``get_slice`` hands out :class:`_CountingSlice`."""

    def __init__(self, real, taken, *args, **kwargs):
        self._handle, self._taken = real(*args, **kwargs), taken

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_slice(self, key):
        return _CountingSlice(self._handle.get_slice(key), self._taken)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def check_reads(hf_dir):
    from shardzoo.checkpoint import hf_files as pretrained  # HFWeights and the safe_open it calls
    from shardzoo.checkpoint.tensors import model_tensors
    from shardzoo.models import GPT2

    mesh = cached_mesh(tp=4, tp_mode="2d")
    read, real_open = pretrained.HFWeights.read, pretrained.safe_open
    returned, taken = [], []

    def counting_read(self, *args, **kwargs):
        out = read(self, *args, **kwargs)
        returned.append(out.numel())
        return out

    pretrained.HFWeights.read = counting_read
    pretrained.safe_open = lambda *args, **kwargs: _CountingOpen(real_open, taken, *args, **kwargs)
    try:
        model = GPT2.from_pretrained(hf_dir, mesh=mesh)
    finally:
        pretrained.HFWeights.read, pretrained.safe_open = read, real_open
    local = model_tensors(model)[0]
    real = sum(math.prod(lt.valid_box()[1]) for lt in local)
    full = sum(math.prod(lt.global_shape) for lt in local)
    return sum(returned), sum(taken), real, full


def test_each_rank_reads_only_its_slices(ckpt):
    """2d tp=4 GPT-2: the elements each rank reads (returned by HFWeights.read, and taken from
    the file's slices) are exactly its parameters' real elements, far fewer than the model's."""
    for returned, taken, real, full in run_on_ranks(check_reads, 4, ckpt["dirs"]["gpt2"]):
        assert returned == taken == real, (returned, taken, real)
        assert 0 < real < full / 2, (real, full)


# -- 5. errors name the problem, on every rank ---------------------------------------------------
def check_errors(dirs):
    from shardzoo.models import BERT, GPT2

    mesh = cached_mesh(tp=2)
    out = {name: _outcome(lambda name=name: GPT2.from_pretrained(dirs[name], mesh=mesh))
           for name in ("missing", "extra", "misshaped", "gpt2_no_weights", "lost_shard")}
    out["wrong_family"] = _outcome(lambda: BERT.from_pretrained(dirs["gpt2"], mesh=mesh))
    # BERT looks at the weights before building the model (is there an MLM head?)
    out["bert_no_weights"] = _outcome(lambda: BERT.from_pretrained(dirs["bert_no_weights"], mesh=mesh))
    lenient = {}
    for name in ("missing", "extra"):
        model = GPT2.from_pretrained(dirs[name], mesh=mesh, strict=False)
        lenient[name] = tuple(model.load_result)
    out["misshaped_lenient"] = _outcome(lambda: GPT2.from_pretrained(dirs["misshaped"], mesh=mesh, strict=False))
    # the problem sits on one pipeline stage only: both stages raise
    stages = cached_mesh(pp=2)
    for name in ("ln_f_shape", "ln_f_missing"):
        out[f"stage_{name}"] = _outcome(lambda name=name: GPT2.from_pretrained(dirs[name], mesh=stages,
                                                                               stage=(stages.pp_rank, 2)))
    return out, lenient


ERRORS = {  # case -> strings the message must contain
    "missing": ["missing", "transformer.h.1.attn.qkv.weight", "transformer.h.1.attn.c_attn.weight"],
    "extra": ["not in the model", "transformer.h.2.ln_1.weight"],
    "misshaped": ["transformer.wpe.weight", "[16, 64]", "[32, 64]"],
    "misshaped_lenient": ["transformer.wpe.weight", "[16, 64]", "[32, 64]"],
    "gpt2_no_weights": ["model.safetensors", "model.safetensors.index.json", "config.json"],
    "bert_no_weights": ["model.safetensors", "model.safetensors.index.json"],
    "lost_shard": ["model.safetensors.index.json"],  # + the shard's name, below
    "wrong_family": ["model_type", "'gpt2'", "'bert'", "GPT2.from_pretrained"],
    "stage_ln_f_shape": ["transformer.ln_f.weight", "[48]", "[64]"],
    "stage_ln_f_missing": ["missing", "transformer.ln_f.bias"],
}


def test_errors_name_the_tensor_on_every_rank(ckpt):
    """Missing, unexpected and mis-shaped tensors, a wrong family, a directory without weights
    and an index naming a lost shard raise CheckpointError on both ranks, naming the keys and
    shapes; strict=False returns the missing / unexpected names instead (shapes still raise)."""
    wanted = {**ERRORS, "lost_shard": ERRORS["lost_shard"] + [ckpt["dirs"]["lost_shard_file"]]}
    results = run_on_ranks(check_errors, 2, ckpt["dirs"])
    for rank, (errors, lenient) in enumerate(results):
        assert set(errors) == set(wanted)
        for case, needles in wanted.items():
            assert errors[case] is not None, f"rank {rank}: {case} raised nothing"
            kind, message = errors[case]
            assert kind == "CheckpointError", (rank, case, kind, message)
            for needle in needles:
                assert needle in message, f"rank {rank} {case}: {needle!r} not in {message!r}"
        assert lenient["missing"] == (["transformer.h.1.attn.qkv.weight"], [])
        assert lenient["extra"] == ([], ["transformer.h.2.ln_1.weight"])
    assert results[0][0] == results[1][0]  # the same message on both ranks
