"""`shardzoo convert` of model-family checkpoints: transformers loads the output (one file and
sharded) and gives the original transformers model's parameters and logits.

Each family: a tiny transformers model (seeded), its weights converted into the shardzoo model
on 2 or 4 ranks, saved without passing config= (the model's own config is recorded), converted
in this process, loaded back with the family's transformers class."""

import argparse
import json
import os

import pytest
import torch

from shardzoo import checkpoint
from shardzoo.checkpoint.cli import add_convert_parser
from shardzoo.models.spec import family_names, spec_named
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS

# the families' tiny configs (FamilySpec.tiny_config: width 32, vocab 101) with the extra
# fields their transformers configs take here
HF_EXTRA = {"gpt2": dict(bos_token_id=0, eos_token_id=0), "opt": dict(word_embed_proj_dim=32)}
# family -> ParallelMesh kwargs (world = product of the sizes)
MESHES = {"gpt2": dict(tp=4, tp_mode="2d"), "bert": dict(tp=2), "vit": dict(tp=2, dp=2), "opt": dict(tp=4)}


# the transformers classes the weights come from; BERT's has the pooler, which shardzoo's BERT
# always builds (BertForMaskedLM, the exported architecture, ignores it)
SOURCES = {"gpt2": ("GPT2LMHeadModel", "GPT2Config"), "bert": ("BertForPreTraining", "BertConfig"),
           "vit": ("ViTForImageClassification", "ViTConfig"), "opt": ("OPTForCausalLM", "OPTConfig")}


def hf_model(family: str, seed: int):
    """The tiny, seeded transformers model ``family``'s weights come from."""
    import transformers

    model_cls, config_cls = SOURCES[family]
    torch.manual_seed(seed)
    fields = spec_named(family).tiny_config() | HF_EXTRA.get(family, {})
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval()


def save_family(family: str, config_json: dict, state: dict, ckpt: str) -> bool:
    """On every rank: the shardzoo model of ``family`` with full-size ``state`` (shardzoo
    names), saved without ``config=`` (save records the model's own config)."""
    fam = spec_named(family)
    config = fam.config.from_json(config_json)
    model = fam.model(config, mesh=cached_mesh(**MESHES[family])).eval()
    model.load_full_state_dict(state)
    checkpoint.save(model, ckpt)
    return True


def save_from_transformers(family: str, seed: int, ckpt: str):
    """The seeded transformers model, after saving its weights as a shardzoo checkpoint on
    the family's ranks (transformers is imported here only, not on the ranks)."""
    fam = spec_named(family)
    hf = hf_model(family, seed)
    config = fam.config.from_json(hf.config.to_dict())
    state = {n: v for name, t in hf.state_dict().items() for n, v in fam.hf_to_shardzoo(name, t, config)}
    run_on_ranks(save_family, world(family), family, config.to_dict(), state, ckpt)
    return hf


def convert(*argv: str) -> None:
    """The ``shardzoo convert`` command, in this process."""
    parser = argparse.ArgumentParser()
    add_convert_parser(parser.add_subparsers())
    args = parser.parse_args(["convert", *argv, "--no-progress"])
    assert args.func(args) == 0


def outputs(family: str, model, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if family == "vit":
            return model(torch.randn(2, 3, 8, 8, generator=gen)).logits
        out = model(torch.randint(1, 101, (2, 7), generator=gen))
        return out.prediction_logits if hasattr(out, "prediction_logits") else out.logits  # BertForPreTraining


def world(family: str) -> int:
    size = 1
    for key in ("tp", "dp", "pp", "sp"):
        size *= MESHES[family].get(key, 1)
    return size


@pytest.mark.parametrize("family", family_names())
def test_convert_loads_in_transformers(tmp_path, family):
    fam = spec_named(family)
    ckpt, out, split = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "hf-split")
    original = save_from_transformers(family, 3, ckpt)
    convert(ckpt, out)
    convert(ckpt, split, "--max-shard-size", "20KB")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    shards = sorted(f for f in os.listdir(split) if f.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(split)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == fam.model_type and config["architectures"] == [fam.architecture]

    import transformers

    reference = outputs(family, original, 4)
    for path in (out, split):
        loaded, info = getattr(transformers, fam.architecture).from_pretrained(path, output_loading_info=True)
        loaded.eval()
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        got, want = loaded.state_dict(), original.state_dict()
        assert [k for k in got if not torch.equal(got[k], want[k])] == []
        assert_close(outputs(family, loaded, 4), reference, f"{family} logits from {os.path.basename(path)}",
                     terms=TINY_MODEL_TERMS)


def test_shardzoo_names_and_unknown_configs(tmp_path):
    """``--names shardzoo`` keeps the saved names and config; the default maps GPT-2 to
    transformers' names (Conv1D transposes, fused QKV split; the tied head stays tied)."""
    from safetensors.torch import load_file

    from shardzoo.models.gpt2 import GPT2Config

    ckpt = str(tmp_path / "ckpt")
    want = save_from_transformers("gpt2", 5, ckpt).state_dict()
    convert(ckpt, str(tmp_path / "raw"), "--names", "shardzoo")
    raw = load_file(str(tmp_path / "raw" / "model.safetensors"))
    assert sorted(raw) == sorted(checkpoint.read_index(ckpt)["tensors"])
    assert "transformer.h.0.attn.qkv.weight" in raw and "lm_head.weight" not in raw
    saved = json.load(open(tmp_path / "raw" / "config.json"))
    assert saved == checkpoint.read_index(ckpt)["config"] and "model_type" not in saved
    assert GPT2Config.from_json(saved).n_embd == spec_named("gpt2").tiny_config()["n_embd"]
    checkpoint.export_plain(ckpt, str(tmp_path / "hf"), progress=False)
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(hf) == sorted(k for k in want if k != "lm_head.weight")
    assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], want["transformer.h.1.mlp.c_fc.weight"])
    with pytest.raises(ValueError, match="names='shardzoo' exports the saved names unchanged"):
        checkpoint.export_plain(ckpt, str(tmp_path / "x"), names="shardzoo", rename=lambda n, t: [(n, t)])


def save_own_and_given_config(own: str, other: str) -> bool:
    """On every rank: a tiny GPT-2 saved without config= and with config={"note": "mine"}."""
    from shardzoo.models.gpt2 import GPT2, GPT2Config

    config = GPT2Config(**spec_named("gpt2").tiny_config())
    model = GPT2(config, mesh=cached_mesh(tp=2))
    checkpoint.save(model, own)
    checkpoint.save(model, other, config={"note": "mine"})
    return True


def test_config_argument_overrides_the_models_own(tmp_path):
    """save records the model's config by itself; config= replaces it. Without a family config
    the default conversion exits 1 and writes nothing."""
    from shardzoo.models.gpt2 import GPT2Config

    own, other = str(tmp_path / "own"), str(tmp_path / "other")
    run_on_ranks(save_own_and_given_config, 2, own, other)
    assert checkpoint.read_index(own)["config_class"] == "shardzoo.models.gpt2.GPT2Config"
    tiny = spec_named("gpt2").tiny_config()
    assert GPT2Config.from_json(checkpoint.read_index(own)["config"]).n_embd == tiny["n_embd"]
    assert checkpoint.read_index(other)["config"] == {"note": "mine"}
    assert checkpoint.read_index(other)["config_class"] is None
    parser = argparse.ArgumentParser()
    add_convert_parser(parser.add_subparsers())
    args = parser.parse_args(["convert", other, str(tmp_path / "out"), "--no-progress"])
    assert args.func(args) == 1 and not os.path.exists(tmp_path / "out")
