"""The README's python snippets run, and what they print or claim holds.

Each ``python`` block of README.md is executed as written; the call under ``if __name__ ==
"__main__":`` (``shardzoo.launch(fn, N, *args)``) is read from the block and run on the test
pool of N ranks instead of N fresh processes (launch gathers the per-rank results the same
way), with ``shardzoo.ParallelMesh`` served from the pool's mesh cache. Relative paths among the
arguments are put under a temporary directory. Checked: snippet 1's coordinates and byte
count, snippet 2's checkpoint through ``shardzoo convert`` into transformers, snippet 3's
shape and its claim that the block equals the serial one, snippet 4's transformers Llama on a
2D mesh against the same model unsplit, snippet 5's pipelined Llama against the same model
unsplit.
"""

import ast
import pathlib
import re

import torch
import torch.distributed as dist

import shardzoo
from shardzoo.cli import main as cli_main
from shardzoo.testing import assert_close, cached_mesh, run_on_ranks
from shardzoo.testing.dtypes import TINY_MODEL_TERMS

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def launch_call(code: str) -> tuple[str, int, list]:
    """(function name, nprocs, literal args) of the ``shardzoo.launch`` call under ``__main__``."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "launch":
            fn, nprocs, *args = node.args
            return fn.id, ast.literal_eval(nprocs), [ast.literal_eval(a) for a in args]
    raise AssertionError(f"no shardzoo.launch(...) call in the snippet:\n{code}")


class _Shardzoo:
    """``shardzoo`` as the snippets see it on the pool: meshes come from the rank's cache, so
    the pool does not build (and leak) new process groups for every run."""

    def __init__(self, **mesh_override):
        self.mesh_override = mesh_override

    def __getattr__(self, name):
        return getattr(shardzoo, name)

    def ParallelMesh(self, **layout):  # noqa: N802  (stands for the class)
        return cached_mesh(**(self.mesh_override or layout))


def snippet_namespace(code: str, **mesh_override) -> dict:
    ns = {"__name__": "readme_snippet"}  # defines everything, skips the __main__ block
    exec(compile(code, str(README), "exec"), ns)
    ns["shardzoo"] = _Shardzoo(**mesh_override)
    return ns


def run_snippet(code: str, fn: str, *args):
    """On a pool rank: the snippet's ``fn(*args)``."""
    return snippet_namespace(code)[fn](*args)


def block_and_serial(code: str):
    """On a pool rank: snippet 3's ``main()`` as written, and again with a tp=1 mesh (every
    rank serial: dp = world); returns (its return value, the two gathered outputs)."""
    outs = []

    def recording(real):
        class Recording:  # the layout object, keeping what gather_output returns
            def __getattr__(self, name):
                return getattr(real, name)

            def gather_output(self, y):
                outs.append(real.gather_output(y).detach())
                return outs[-1]
        return Recording()

    ns = snippet_namespace(code)
    layout_of = ns["layout_of"]
    ns["layout_of"] = lambda mesh: recording(layout_of(mesh))
    result = ns["main"]()
    ns["shardzoo"] = _Shardzoo(dp=dist.get_world_size())
    ns["main"]()
    return result, outs[0], outs[1]


def test_readme_has_the_five_snippets():
    assert len(python_blocks()) == 5


def test_first_look_snippet():
    code = python_blocks()[0]
    fn, nprocs, args = launch_call(code)
    results = run_on_ranks(run_snippet, nprocs, code, fn, *args)
    coords = [tuple(c.values()) for c, _ in results]
    assert len(set(coords)) == nprocs == 8 and all(set(c) == {"dp", "pp", "sp", "tp_row", "tp_col"}
                                                   for c, _ in results)
    # all_gather over tp_col (2 ranks) of [4, 16] fp32 into [4, 32]: (p - 1) / p of the output
    p, gathered = 2, 4 * 16 * 2 * 4
    assert [b for _, b in results] == [gathered * (p - 1) // p] * nprocs


def test_pretrained_training_checkpoint_snippet(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    code = python_blocks()[1]
    fn, nprocs, args = launch_call(code)
    hf_dir, ckpt_dir = (str(tmp_path / a) for a in args)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=64))
    hf.save_pretrained(hf_dir)
    run_on_ranks(run_snippet, nprocs, code, fn, hf_dir, ckpt_dir)
    convert = re.search(r"# then: shardzoo (convert \S+ \S+)", code)[1].split()  # the command the snippet names
    assert convert[1] == args[1]
    out = str(tmp_path / convert[2])
    assert cli_main([convert[0], ckpt_dir, out, "--no-progress"]) == 0
    loaded, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    before, after = hf.state_dict(), loaded.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert "transformer.h.0.attn.c_attn.weight" in moved  # one AdamW step moved the weights
    assert all((before[k] - after[k]).abs().max() < 1e-3 for k in before)  # lr 1e-4: one small step


def test_block_snippet_equals_serial():
    code = python_blocks()[2]
    fn, nprocs, _ = launch_call(code)
    assert fn == "main"
    for shape, parallel, serial in run_on_ranks(block_and_serial, nprocs, code):
        assert shape == (8, 16, 64) == tuple(parallel.shape)
        assert_close(parallel, serial, "README block vs serial", terms=TINY_MODEL_TERMS)


def model_and_serial(code: str):
    """On a pool rank: snippet 4's ``main()`` as written, and again with a tp=1 mesh (every rank
    the unsplit transformers model, the same batch on each dp replica)."""
    ns = snippet_namespace(code)
    result = ns["main"]()
    ns["shardzoo"] = _Shardzoo(dp=dist.get_world_size())
    return result, ns["main"]()


def test_bring_your_own_model_snippet_equals_serial():
    code = python_blocks()[3]
    fn, nprocs, _ = launch_call(code)
    assert fn == "main" and "parallelize" in code
    for (loss, shape), (serial_loss, serial_shape) in run_on_ranks(model_and_serial, nprocs, code):
        assert shape == serial_shape == (4, 32, 128)
        assert abs(loss - serial_loss) <= 1e-4, (loss, serial_loss)  # both rounded to 4 places


def test_pipelined_llama_snippet_equals_serial():
    code = python_blocks()[4]
    fn, nprocs, _ = launch_call(code)
    assert fn == "main" and "shardzoo.pipeline" in code
    model, ids = snippet_namespace(code)["build"]()
    serial = round(model(input_ids=ids, labels=ids).loss.item(), 4)
    claimed = float(re.search(r"# \[([0-9.]+)\] \* 4", code)[1])
    assert run_on_ranks(run_snippet, nprocs, code, fn) == [serial] * nprocs and claimed == serial
