"""The family registry (models/spec.py): every model file's spec is registered, subclasses of a
family's model or config belong to that family (so a user's ``class MyGPT2(GPT2)`` loads
Hugging Face weights), and checkpoints keep finding their export adapter by the recorded
config class path."""

import pytest
import torch

from shardzoo.checkpoint.adapters import export_adapter
from shardzoo.models import GPT2, GPT2Config, all_specs, spec_named, spec_of
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS
from support.hf_twins import hf_gpt2


class MyGPT2(GPT2):
    """A user's subclass, defined outside shardzoo."""


class MyGPT2Config(GPT2Config):
    pass


def test_registry_holds_each_model_file_spec():
    from shardzoo.models import bert, gpt2, opt, vit

    assert [s.name for s in all_specs()] == ["bert", "gpt2", "opt", "vit"]
    assert [spec_named(n) for n in ("bert", "gpt2", "opt", "vit")] == \
        [bert.BERT_SPEC, gpt2.GPT2_SPEC, opt.OPT_SPEC, vit.VIT_SPEC]
    for spec in all_specs():
        assert spec_of(spec.model) is spec and spec_of(spec.config) is spec
        assert spec.model.__module__ == spec.config.__module__ == f"shardzoo.models.{spec.name}"


@pytest.mark.parametrize("name", ["bert", "gpt2", "opt", "vit"])
def test_checkpoints_saved_before_find_their_adapter(name):
    """Indexes record ``config_class`` as the module path of the family's config."""
    spec = spec_named(name)
    path = f"shardzoo.models.{name}.{spec.config.__name__}"
    assert spec.config_path == path and export_adapter(path).config_class == path


def test_subclasses_inherit_the_spec():
    config = MyGPT2Config(**spec_named("gpt2").tiny_config())
    assert spec_of(MyGPT2) is spec_named("gpt2") and spec_of(MyGPT2Config) is spec_named("gpt2")
    assert spec_of(config) is spec_named("gpt2")
    with pytest.raises(ValueError, match="is not a model or config of a registered family"):
        spec_of(torch.nn.Linear)
    with pytest.raises(ValueError, match=r"unknown model family 'llama'; choose one of \['bert', 'gpt2'"):
        spec_named("llama")
    assert spec_named("GPT-2") is spec_named("gpt2")


def build_tiny(name):
    spec = spec_named(name)
    model = spec.model(spec.config(**spec.tiny_config()), mesh=cached_mesh(), seed=0)
    assert spec_of(model) is spec and sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("name", [s.name for s in all_specs()])
def test_tiny_configs_build(name):
    run_on_ranks(build_tiny, 1, name)  # in a worker: a mesh starts a process group, which this process must not hold


def load_subclass(hf_dir, ids):
    mesh = cached_mesh(tp=2)
    model = MyGPT2.from_pretrained(hf_dir, mesh=mesh).eval()
    assert type(model) is MyGPT2 and model.load_result == ([], [])
    with torch.no_grad():
        return model.gather_output(model(model.shard_input(ids)))


def test_user_subclass_loads_pretrained(tmp_path):
    hf = hf_gpt2(0)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits.detach()
    for got in run_on_ranks(load_subclass, 2, str(tmp_path), ids):
        assert_close(got, want, "MyGPT2 logits", terms=TINY_MODEL_TERMS)
