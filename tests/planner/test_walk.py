"""Models priced by walking their modules and plan (planner/walk.py): the transformers presets
and their published sizes, ``shardzoo plan DIR`` for a transformers causal LM and its run lines
(which build, split and step the pick) and the layout rules parallelize applies. The planner
without transformers is checked in tests/test_package.py, the exact bytes in test_exact.py."""

import json
import re

import pytest
import torch

import shardzoo
from shardzoo.cli import main
from shardzoo.planner.advice import run_lines
from shardzoo.planner.presets import HARDWARE, HF_MODELS, load_model
from shardzoo.testing import run_on_ranks
from support.user_model import PLAN, TinyLM

TINY_LLAMA = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=101, max_position_embeddings=64, tie_word_embeddings=False)


def tiny_llama_dir(tmp_path) -> str:
    from transformers import LlamaConfig

    LlamaConfig(**TINY_LLAMA).save_pretrained(tmp_path)
    return str(tmp_path)


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# serial parameters of each preset: the published counts of the checkpoints (their safetensors'
# parameter totals), which the presets' config values must rebuild
PUBLISHED = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800,
             "qwen2.5-7b": 7_615_616_512,
             # mixtures of experts, all experts counted: Mixtral-8x7B 46.7B, Qwen3-30B-A3B 30.5B
             "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_transformers_presets_have_their_published_size(name):
    shape = load_model(name)
    assert shape.builder is None and shape.parameters == PUBLISHED[name], (name, shape.parameters)
    serial = shardzoo.plan(shape, 1, 1e7, 1, 128, hardware="h100", zero_stages=(0,), checkpointing=(False,),
                           tp_modes=("1d",))
    assert serial[0].param_bytes_per_rank == 4 * PUBLISHED[name]


def test_llama3_70b_plans_on_512_h100s(capsys):
    code, out, _ = run(capsys, ["plan", "llama3-70b", "--world", "512", "--hardware", "h100", "--device-memory-gib",
                                "80", "--global-batch", "512", "--seq", "8192", "--top", "3"])
    assert code == 0, out
    rows = [line for line in out.splitlines() if re.match(r"\s*1\s", line)]
    assert rows and "llama3-70b on 512 x h100" in out
    assert "model = shardzoo.parallelize(model, mesh" in out and "AutoModelForCausalLM" in out
    assert "GPT2(" not in out and "build_schedule" not in out


def test_tiny_llama_directory_plans_pipelines_and_prices_gqa(tmp_path, capsys):
    path = tiny_llama_dir(tmp_path)
    code, out, _ = run(capsys, ["plan", path, "--world", "8", "--device-memory-gib", "80", "--global-batch", "8",
                                "--seq", "32", "--hardware", "a100", "--json"])
    data = json.loads(out)
    assert code == 0 and data["candidates"] and {c["layout"]["pp"] for c in data["candidates"]} == {1, 2}
    planned = shardzoo.plan(path, 8, 80, 8, 32, hardware="a100")
    assert data["pick"]["run"] == run_lines(planned, planned[0])
    assert any("pp=4 exceeds the model's 2 blocks" in p.reason for p in planned.pruned)
    # pp=2: parallelize cuts one block per stage; the last stage (a block, the norm and the head)
    # is the larger, and the lines that run it cut and pipeline the model
    piped = next(c for c in planned if c.layout["pp"] == 2 and c.layout["tp"] == 1 and c.zero == 0)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        serial = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    block = sum(p.numel() for p in serial.model.layers[0].parameters())
    last = block + serial.model.norm.weight.numel() + serial.lm_head.weight.numel()
    assert piped.param_bytes_per_rank == 4 * last
    lines = run_lines(planned, piped)
    assert any("stages=[1, 1]" in line for line in lines) and any("shardzoo.pipeline(" in line for line in lines)
    # tp=8 1d: 8 head parts over 2 kv heads, each kv head repeated on 4 ranks (a column layer of 8 x 8 features)
    one = next(c for c in planned if c.layout["tp"] == 8 and c.layout["tp_mode"] == "1d" and c.zero == 0)
    h, f, v, kv = 64, 96, 101, 8 * 8  # kv: the repeated projection's outputs, 8 parts x head_dim 8
    block = (2 * h * h + 2 * kv * h) // 8 + 3 * h * f // 8 + 2 * h
    assert one.param_bytes_per_rank == 4 * (2 * block + 2 * (-(-v // 8)) * h + h)


def test_layout_rules_of_a_walked_model(tmp_path):
    path = tiny_llama_dir(tmp_path)
    planned = shardzoo.plan(path, 12, 80, 12, 24, hardware="a100", sp_mode="ulysses")
    reasons = [p.reason for p in planned.pruned]
    assert any("splits the heads in 3 parts, which must divide its 8 heads" in r for r in reasons)
    assert any(r.startswith("Ulysses needs the heads per tp rank divisible by sp=3") for r in reasons)
    with pytest.raises(ValueError, match="--seq 128 exceeds"):
        shardzoo.plan(path, 2, 80, 2, 128, hardware="a100")


def test_a_module_of_ones_own_is_walked_with_its_plan():
    with torch.device("meta"):
        model = TinyLM(dropout=0.1)
    from shardzoo.planner.walked import walked_model

    planned = shardzoo.plan(walked_model(model, PLAN, "tinylm"), 4, 80, 4, 16, hardware=HARDWARE["a100"],
                            dtype="fp32")
    serial = next(c for c in planned if c.layout["dp"] == 4 and c.zero == 0)
    assert serial.param_bytes_per_rank == 4 * sum(p.numel() for p in model.parameters())
    assert "plan=plan" in run_lines(planned, planned[0])[2]
    with pytest.raises(ValueError, match="--seq 32 exceeds tinylm's 16 positions"):  # its position table's rows
        shardzoo.plan(walked_model(model, PLAN, "tinylm"), 4, 80, 4, 32)
    with pytest.raises(ValueError, match="no tensor-parallel plan of its own"):
        shardzoo.plan(model, 4, 80, 4, 16)
    with pytest.raises(ValueError, match="makes embed \\(Embedding\\) a 'column' block"):
        walked_model(model, PLAN | {"embed": "column"})
    with pytest.raises(ValueError, match=r"plan entries \['blocks.\*.mlp'\] match no module"):
        walked_model(model, PLAN | {"blocks.*.mlp": "column"})
    with pytest.raises(ValueError, match=r"ln_f \(LayerNorm\) is not in the plan"):
        walked_model(model, {k: v for k, v in PLAN.items() if k != "ln_f"})


def exec_walked_run_lines(lines: list[str], hf_dir: str):
    """On a pool rank: the run lines (but the torchrun command) with ``config`` read from
    ``hf_dir`` and ``ids`` a batch of this dp replica, then the backward and optimizer step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardzoo.testing import cached_mesh

    proxy = type("Shardzoo", (), {"__getattr__": lambda self, n: getattr(shardzoo, n),
                                  "ParallelMesh": staticmethod(lambda **kw: cached_mesh(**kw))})()
    torch.manual_seed(0)
    ns = dict(torch=torch, shardzoo=proxy, AutoModelForCausalLM=AutoModelForCausalLM,
              config=AutoConfig.from_pretrained(hf_dir))
    for line in lines[:-1]:
        if line.startswith("loss = "):
            mesh = ns["mesh"]
            ns["ids"] = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(1)).chunk(
                mesh.dp_size)[mesh.dp_rank]
        exec(line, ns)
    ns["loss"].backward()
    ns["optimizer"].step()
    return {a: ns["mesh"].size(a) for a in ("dp", "sp", "tp")}, float(ns["loss"])


def test_run_lines_of_a_walked_model_build_and_step_the_pick(tmp_path):
    """The lines of a data-parallel, tensor-parallel candidate of a transformers Llama split by
    parallelize run a training step: the loss is the global mean, the same on every rank."""
    path = tiny_llama_dir(tmp_path)
    planned = shardzoo.plan(path, 4, 80, 4, 16, hardware="a100", dtype="fp32")
    cand = next(c for c in planned if c.layout == dict(dp=2, pp=1, sp=1, tp=2, tp_mode="1d", tp_depth=1)
                and c.zero == 1 and c.activation_checkpointing)
    results = run_on_ranks(exec_walked_run_lines, 4, run_lines(planned, cand), path)
    assert all(sizes == {k: cand.layout[k] for k in sizes} for sizes, _ in results)
    losses = {loss for _, loss in results}
    assert len(losses) == 1 and 0 < losses.pop() < 10  # ln 101 ~ 4.6


def test_the_planner_names_no_family():
    """The planner prices every model from its modules and plan: no registered family, its
    classes, model_type or presets is named under shardzoo/planner (the presets live with the
    families, in their specs)."""
    import pathlib
    import re

    import shardzoo.models  # noqa: F401  (registers the families)
    from shardzoo.models.spec import all_specs

    words = {w for s in all_specs() for w in (s.name, s.model.__name__, s.config.__name__, s.model_type, *s.presets)}
    found = []
    for path in sorted((pathlib.Path(shardzoo.__file__).parent / "planner").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [(path.name, number, w) for w in words
                      if re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", line, re.IGNORECASE)]
    assert not found, found


def test_megatron_sp_refuses_a_block_weight_off_the_sequence_chunks():
    """A weight inside a block planned with a style that cannot run on a sequence chunk is
    refused in 1d tp > 1 as parallelize refuses it, naming the module and both fixes; with
    Megatron sequence parallelism priced off the same layout is priced."""
    from shardzoo.planner.api import price
    from shardzoo.planner.walked import walked_model

    with torch.device("meta"):
        model = TinyLM()
    shape = walked_model(model, {**PLAN, "blocks.*.ln_*": "replicate"})
    with pytest.raises(ValueError) as err:
        price(shape, 2, 4, 16, "tp=2", hardware="a100")
    assert "blocks.0.ln_" in str(err.value) and "sequence_parallel=False" in str(err.value), err.value
    assert price(shape, 2, 4, 16, "tp=2", hardware="a100", sequence_parallel=False).candidate.fits
