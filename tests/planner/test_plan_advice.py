"""What ``shardzoo plan`` says about its pick: the memory terms of the why line add up to the
peak shown (runtime and workspace included), the lines that run the pick match it, ``--json``
carries both under ``pick``; ``--explain`` names the rule a request breaks."""

import ast
import json
import re

import pytest
import torch

import shardzoo
from shardzoo.cli import main
from shardzoo.planner.advice import memory_terms, rounded_gib, run_lines
from shardzoo.planner.hardware import GIB
from shardzoo.testing import run_on_ranks

# (argv after "plan", shardzoo.plan arguments): one data-parallel pick, one pipelined over nodes
CASES = {
    "gpt2-8": (["gpt2", "--world", "8", "--device-memory-gib", "80", "--global-batch", "16", "--seq", "128",
                "--hardware", "a100"], ("gpt2", 8, 80, 16, 128), {"hardware": "a100"}),
    "gpt2-xl-64": (["gpt2-xl", "--world", "64", "--device-memory-gib", "8", "--global-batch", "64", "--seq", "1024",
                    "--hardware", "h100"], ("gpt2-xl", 64, 8, 64, 1024), {"hardware": "h100"}),
}


def run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def call_kwargs(line: str) -> dict:
    """The keyword arguments of the call on ``line`` (``x = f(a=1, ...)``)."""
    call = ast.parse(line).body[0].value
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "loss_fn"}


def test_memory_terms_sum_to_every_candidates_peak():
    for _, args, kwargs in CASES.values():
        planned = shardzoo.plan(*args, **kwargs)
        for cand in planned:
            terms = memory_terms(cand)
            assert set(terms) >= {"runtime", "workspace"} and sum(terms.values()) == cand.peak_bytes_per_rank


def test_rounded_terms_add_up_to_the_rounded_total():
    for parts in ([1, 1, 1], [GIB // 3] * 3, [int(0.004 * GIB)] * 6, [7 * GIB // 9, GIB // 7, 0, 5 * GIB // 11]):
        shown, total = rounded_gib(parts, 2)
        assert round(sum(shown), 6) == total == round(sum(parts) / GIB, 2)
        assert all(abs(s - p / GIB) < 0.01 for s, p in zip(shown, parts))


@pytest.mark.parametrize("case", sorted(CASES))
def test_why_line_adds_up_and_run_lines_run_the_pick(case, capsys):
    argv, args, kwargs = CASES[case]
    code, out, _ = run(capsys, ["plan", *argv, "--top", "2"])
    best = shardzoo.plan(*args, **kwargs)[0]
    assert code == 0
    why_line = next(line for line in out.splitlines() if line.startswith("why #1"))
    found = re.search(r"peak ([\d.]+) GiB = (.*)$", why_line)
    terms = dict((name, float(v)) for name, v in re.findall(r"([a-z ]+?) ([\d.]+)(?: \+ |$)", found[2]))
    assert list(terms) == [name.replace("_", " ") for name in memory_terms(best)]
    assert float(found[1]) == round(best.peak_bytes_per_rank / GIB, 2) == round(sum(terms.values()), 6)
    lines = out.split("run #1 (on every rank; config: the model's config):\n")[1].splitlines()
    assert [line.strip() for line in lines] == run_lines(shardzoo.plan(*args, **kwargs), best)
    mesh = call_kwargs(lines[0].strip())
    lay = best.layout
    assert mesh == {k: v for k, v in lay.items() if k != "tp_depth" or lay["tp_mode"] == "2.5d"}
    world = lay["dp"] * lay["pp"] * lay["sp"] * lay["tp"]
    command = lines[-1].strip()
    nodes = re.search(r"--nnodes (\d+)", command)
    per_node = int(re.search(r"--nproc-per-node (\d+)", command)[1])
    assert per_node * (int(nodes[1]) if nodes else 1) == world, command
    schedule = [line for line in lines if "build_schedule(" in line or "shardzoo.pipeline(" in line]
    if lay["pp"] > 1:  # the pick's own schedule: several stages per rank built as a list, run by shardzoo.pipeline
        called = call_kwargs(schedule[0].strip())
        assert called["n_microbatches"] == best.micro_batches
        assert called["schedule"] == {"interleaved": "interleaved_1f1b"}.get(best.schedule, best.schedule)
        chunked = best.virtual_stages > 1
        assert ("stages = " in lines[1]) == chunked and ("stage=(mesh.pp_rank, mesh.pp_size)" in lines[1]) != chunked
    else:
        assert not schedule
    if lay["dp"] * lay["sp"] > 1:
        wrap = next(line.strip() for line in lines if "shardzoo.data_parallel(" in line)
        assert f"zero={best.zero})" in wrap


def test_json_pick_holds_the_terms_and_the_run_lines(capsys):
    argv, args, kwargs = CASES["gpt2-xl-64"]
    code, out, _ = run(capsys, ["plan", *argv, "--json", "--top", "3"])
    data = json.loads(out)
    pick, first = data["pick"], data["candidates"][0]
    assert code == 0 and pick["peak_bytes_per_rank"] == first["peak_bytes_per_rank"]
    assert sum(pick["memory_terms"].values()) == first["peak_bytes_per_rank"]
    assert pick["run"] == run_lines(shardzoo.plan(*args, **kwargs), shardzoo.plan(*args, **kwargs)[0])
    nothing = shardzoo.plan("gpt2-xl", 4, 0.5, 8, 1024, hardware="a100")
    assert not nothing.fits and nothing.to_json()["pick"] is None


def test_explain_names_the_rule_the_request_breaks(capsys):
    argv = CASES["gpt2-8"][0]
    code, out, _ = run(capsys, ["plan", *argv, "--explain", "tp=8,tp_mode=2d"])
    assert code == 0 and "tp_mode='2d' needs tp to be a perfect square q*q; got tp=8" in out
    assert "world size" not in out
    code, out, _ = run(capsys, ["plan", *argv, "--explain", "dp=8"])
    assert code == 0 and "not legal" not in out and "num_heads" not in out and "8 candidates" in out
    assert "  run it (on every rank" in out and "mesh = shardzoo.ParallelMesh(dp=8, pp=1" in out  # its run lines
    code, out, _ = run(capsys, ["plan", *argv, "--explain", "dp=3"])
    assert "dp = 3 does not divide the world size 8" in out
    code, out, _ = run(capsys, ["plan", *argv, "--explain", "dp=2,pp=1,sp=1,tp=2"])
    assert "dp*pp*sp*tp = 4 is not the world size 8" in out


def pool_shardzoo():
    """shardzoo as run lines see it on a pool rank: its ParallelMesh is the pool's cached one."""
    from shardzoo.testing import cached_mesh

    return type("Shardzoo", (), {"__getattr__": lambda self, n: getattr(shardzoo, n),
                                 "ParallelMesh": staticmethod(lambda **kw: cached_mesh(**kw))})()


def exec_run_lines(lines: list[str], hf_dir: str):
    """On a pool rank: the run lines (but the torchrun command and the autocast hint) executed
    with ``config`` read from ``hf_dir``, then one pipeline step and the optimizer step."""
    from shardzoo.models import GPT2, GPT2Config
    from shardzoo.models.pipeline import build_schedule

    ns = dict(torch=torch, shardzoo=pool_shardzoo(), GPT2=GPT2, build_schedule=build_schedule,
              config=GPT2Config.from_json(hf_dir))
    for line in lines[:-1]:
        if not line.startswith("with autocast"):
            exec(line, ns)
    model, mesh = ns["model"], ns["mesh"]
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0)).chunk(mesh.dp_size)[mesh.dp_rank]
    losses = []
    if model.is_first:
        ns["schedule"].step(model.shard_input(ids))
    else:
        ns["schedule"].step(target=model.target_from_labels(ids), losses=losses)
    ns["optimizer"].step()
    return {a: mesh.size(a) for a in ("dp", "pp", "sp", "tp")}, float(sum(losses)) if losses else None


def test_run_lines_build_and_step_the_pick(tmp_path):
    """The lines of a pipelined, data-parallel candidate (ZeRO-1: data_parallel returns a DDP
    wrapper, whose model keeps the loss) build the layout and run a training step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)).save_pretrained(tmp_path)
    planned = shardzoo.plan(str(tmp_path), 4, 80, 8, 16, hardware="a100")
    cand = next(c for c in planned if c.layout["pp"] == 2 and c.layout["dp"] == 2 and c.zero == 1)
    results = run_on_ranks(exec_run_lines, 4, run_lines(planned, cand), str(tmp_path))
    assert all(sizes == {k: cand.layout[k] for k in sizes} for sizes, _ in results)
    losses = [loss for _, loss in results if loss is not None]
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < losses[0] < 10  # the step's global mean, ln 64 ~ 4.2


def exec_walked_lines(lines: list[str], config: dict):
    """On a pool rank: the run lines of a walked transformers model (but the launch command and
    the autocast hint) executed, which build the layout and run one pipeline step; the loss."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return exec_lines(lines, dict(AutoModelForCausalLM=AutoModelForCausalLM, config=LlamaConfig(**config)),
                      config["vocab_size"])


def exec_lines(lines: list[str], names: dict, vocab: int) -> float:
    """Execute run lines (but the launch command and the autocast hint) with ``names`` and a
    shardzoo whose ParallelMesh is the pool's cached one, ``ids`` this dp replica's rows of a
    fixed [8, 16] batch; then the optimizer step. The step's loss."""
    ns = dict(names, torch=torch, shardzoo=pool_shardzoo())
    ids = torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    for line in lines[:-1]:
        if line.startswith("loss = "):
            ns["ids"] = ids.chunk(ns["mesh"].dp_size)[ns["mesh"].dp_rank]
        if not line.startswith("with autocast"):
            exec(line, ns)
    ns["optimizer"].step()
    return float(ns["loss"])


def test_run_lines_of_every_schedule_name_it_and_a_zbv_pick_runs():
    """A walked model's pipelined candidates under each schedule the enumeration tries: the
    parallelize line cuts 2 * pp stages (the V placement for zbv and dualpipev), the pipeline
    line names the schedule as shardzoo.pipeline does; the lines of the zbv one run a step."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  num_hidden_layers=4, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    planned = shardzoo.plan(model, 4, 80, 8, 16, hardware="a100", tp_modes=("1d",), checkpointing=(False,))
    picks = {}
    for cand in planned:
        if cand.layout == dict(dp=2, pp=2, sp=1, tp=1, tp_mode="1d", tp_depth=1) and cand.zero == 0:
            picks.setdefault(cand.schedule, cand)
    assert set(picks) == {"1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev"}
    for name, cand in picks.items():
        lines = run_lines(planned, cand)
        cut = call_kwargs(next(line for line in lines if "shardzoo.parallelize(" in line))
        v = cand.virtual_stages
        assert cut["stages"] == [4 // (2 * v)] * (2 * v) and cut.get("virtual_stages", 1) == v
        assert cut.get("placement", "loop") == ("v" if name in ("zbv", "dualpipev") else "loop")
        run = call_kwargs(next(line for line in lines if "shardzoo.pipeline(" in line))
        assert run == {"n_microbatches": cand.micro_batches,
                       "schedule": {"interleaved": "interleaved_1f1b"}.get(name, name)}
    losses = run_on_ranks(exec_walked_lines, 4, run_lines(planned, picks["zbv"]), config)
    assert len(set(losses[:2])) == 1 and 0 < losses[0] < 10  # every rank of a replica: its step's global mean


def exec_family_lines(lines: list[str], hf_dir: str):
    """On a pool rank: a family's run lines (but the launch command and the autocast hint)
    executed, then one pipeline step and the optimizer step; the step's loss."""
    from shardzoo.models import GPT2, GPT2Config

    return exec_lines(lines, dict(GPT2=GPT2, config=GPT2Config.from_json(hf_dir)), 64)


def test_family_run_lines_of_a_v_schedule_run(tmp_path):
    """A family's pick under DualPipeV: this rank's two stages of the V built as a list, each
    through data_parallel, run by shardzoo.pipeline."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=64)).save_pretrained(tmp_path)
    planned = shardzoo.plan(str(tmp_path), 4, 80, 8, 16, hardware="a100", tp_modes=("1d",), checkpointing=(False,))
    assert all(c.micro_batches >= 4 for c in planned if c.schedule == "dualpipev")  # torch's: one per stage
    cand = next(c for c in planned if c.layout["pp"] == 2 and c.layout["dp"] == 2 and c.schedule == "dualpipev"
                and c.zero == 0)
    lines = run_lines(planned, cand)
    assert lines[1] == "stages = [(mesh.pp_rank, 2 * mesh.pp_size), (2 * mesh.pp_size - 1 - mesh.pp_rank, 2 * mesh.pp_size)]"
    losses = run_on_ranks(exec_family_lines, 4, lines, str(tmp_path))
    assert losses[0] == losses[1] and 0 < losses[0] < 10  # the replica's step's global mean on each of its ranks
